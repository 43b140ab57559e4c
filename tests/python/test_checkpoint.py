"""wna16.MoeLayer.from_checkpoint (the library's loader) against `wna16 run` on the same
checkpoint and input: equal bit for bit on the CPU backend, for each activation dtype and for
[M, H] and [B, T, H] inputs; and the loader's errors reach Python as exceptions."""
import pytest
import torch

import wna16
from conftest import cli, read_safetensors, write_safetensors

CASES = [  # (arch, format, flags, MoE layer)
    ("deepseek_v3", "gptq", ("--desc-act",), 1),
    ("qwen2_moe", "awq", ("--group-size", "64"), 0),
    ("mixtral", "gptq_v2", ("--asym", "--bits", "8", "--group-size", "64"), 1),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "f32"])
@pytest.mark.parametrize("arch,fmt,flags,layer", CASES, ids=[c[0] for c in CASES])
def test_from_checkpoint_equals_cli_run(synth, tmp_path, arch, fmt, flags, layer, dtype):
    d = synth(arch, fmt, *flags)
    model = wna16.MoeLayer.from_checkpoint(d, layer)
    shape = (3, 5, model.hidden)  # [B, T, H]: the CLI reads it as 15 rows
    x = torch.randn(shape, generator=torch.Generator().manual_seed(len(arch))).to(dtype)
    write_safetensors(tmp_path / "x.safetensors", {"hidden_states": x})
    cli("run", d, "--layer", layer, "--input", tmp_path / "x.safetensors", "--output", tmp_path / "y.safetensors",
        "--device", "cpu")
    want = read_safetensors(tmp_path / "y.safetensors")["hidden_states"]
    got = model(x)
    assert got.dtype == want.dtype == dtype and got.shape == want.shape == shape
    assert torch.equal(got, want), f"max |diff| {(got.float() - want.float()).abs().max()}"
    assert torch.equal(model(x.reshape(-1, model.hidden)), got.reshape(-1, model.hidden))


def test_loader_errors_raise(synth, tmp_path):
    with pytest.raises(ValueError, match="nowhere"):
        wna16.MoeLayer.from_checkpoint(tmp_path / "nowhere", 0)
    d = synth("deepseek_v3", "gptq", "--desc-act")
    with pytest.raises(ValueError, match="layer 0|dense"):
        wna16.MoeLayer.from_checkpoint(d, 0)  # DeepSeek-V3 synth: layer 0 is dense
    with pytest.raises(ValueError, match="99"):
        wna16.MoeLayer.from_checkpoint(d, 99)
