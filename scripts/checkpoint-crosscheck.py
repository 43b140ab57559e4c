#!/usr/bin/env python3
"""Cross-checks wna16's checkpoint files against the Hugging Face reference implementations.

Needs torch, safetensors and transformers (the GPU machine has them; CI does not run this). For each
architecture x {gptq 4-bit sym, gptq 4-bit desc_act, gptq 8-bit, gptq_v2 asym, awq}:
  1. `wna16 synth` writes a checkpoint; every shard opens with the reference reader
     (safetensors.safe_open) and together they hold exactly the tensors of the index;
  2. transformers.AutoConfig reads its config.json (model_type, sizes, quantization_config);
  3. transformers' own MoE block of that architecture (MixtralSparseMoeBlock, ...), loaded with the
     weights dequantized here from the raw qweight/qzeros/scales/g_idx (formats.md, a third
     implementation), runs in float64 on the same hidden states; `wna16 run --device cpu` (and cuda
     when asked) must agree with it within the bf16 tolerance, and its output file must open with
     safetensors.torch.load_file.
Then the fuzz seeds: the reference reader must reject exactly the files named broken_*.

Usage: scripts/checkpoint-crosscheck.py WNA16_CLI WORKDIR [--device cpu,cuda] [--seeds DIR]
Exit status 0 iff every check passed.
"""
import argparse
import importlib
import json
import os
import subprocess
import sys
import traceback

import torch
from safetensors import safe_open
from safetensors.torch import load_file

ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "glm4_moe", "qwen3_next"]
VARIANTS = [
    ("gptq 4-bit sym", ["--format", "gptq", "--bits", "4"]),
    ("gptq 4-bit desc_act", ["--format", "gptq", "--bits", "4", "--desc-act"]),
    ("gptq 8-bit", ["--format", "gptq", "--bits", "8"]),
    ("gptq_v2 4-bit asym", ["--format", "gptq_v2", "--bits", "4", "--asym"]),
    ("awq 4-bit", ["--format", "awq"]),
]
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of a word holds column 8c + AWQ_ORDER[i]
TOLERANCE = 1.5e-2                     # wna16's bf16 layer tolerance (layer_tolerance(BF16))


def load_checkpoint(d):
    """All tensors of the directory, checking the index against the shards."""
    index = os.path.join(d, "model.safetensors.index.json")
    files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    tensors, seen = {}, {}
    for f in files:
        with safe_open(os.path.join(d, f), framework="pt") as h:
            for k in h.keys():
                assert k not in tensors, f"{k} in two shards"
                tensors[k] = h.get_tensor(k)
                seen[k] = f
    if os.path.exists(index):
        wm = json.load(open(index))["weight_map"]
        assert wm == seen, "index weight_map differs from the shards' contents"
    return tensors, len(files)


def unpack_along_rows(words, bits):
    """GPTQ qweight [K*bits/32, N] -> codes [K, N]; value j of a word at bits [bits*j, bits*j+bits)."""
    pack = 32 // bits
    shifts = (torch.arange(pack, dtype=torch.int32) * bits).view(1, pack, 1)
    q = (words.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return q.reshape(-1, words.shape[1])


def unpack_along_cols(words, bits):
    """GPTQ qzeros [G, N*bits/32] -> [G, N]."""
    pack = 32 // bits
    shifts = (torch.arange(pack, dtype=torch.int32) * bits).view(1, 1, pack)
    q = (words.unsqueeze(2) >> shifts) & ((1 << bits) - 1)
    return q.reshape(words.shape[0], -1)


def unpack_awq(words):
    """AWQ [R, N/8] -> [R, N] undoing the [0,2,4,6,1,3,5,7] interleave."""
    shifts = (torch.arange(8, dtype=torch.int32) * 4).view(1, 1, 8)
    nib = (words.unsqueeze(2) >> shifts) & 0xF          # [R, N/8, 8], nibble order
    out = torch.empty_like(nib)
    out[:, :, AWQ_ORDER] = nib                          # column 8c + ORDER[i] <- nibble i
    return out.reshape(words.shape[0], -1)


def dense_weights(tensors, qcfg):
    """module -> float64 weight in torch layout [N, K], for every quantized and dense linear."""
    method = qcfg.get("quant_method")
    bits = qcfg.get("bits")
    group = qcfg.get("group_size")
    v1 = qcfg.get("checkpoint_format", "gptq") == "gptq"
    out = {}
    for name in tensors:
        if name.endswith(".qweight"):
            m = name[: -len(".qweight")]
            qw, qz = tensors[m + ".qweight"], tensors[m + ".qzeros"]
            s = tensors[m + ".scales"].double()
            if method == "awq":
                q = unpack_awq(qw)
                z = unpack_awq(qz)
                K = q.shape[0]
                g = torch.arange(K) // (K if group == -1 else group)
                w = (q.double() - z[g].double()) * s[g]
            else:
                q = unpack_along_rows(qw, bits)
                z = unpack_along_cols(qz, bits).double() + (1.0 if v1 else 0.0)
                g = tensors[m + ".g_idx"].long()
                w = s[g] * (q.double() - z[g])
            out[m] = w.t().contiguous()
        elif name.endswith(".weight") and tensors[name].dim() == 2:
            out[name[: -len(".weight")]] = tensors[name].double()
    return out


def moe_block_class(model_type):
    mod = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    # Mixtral / Qwen: ...SparseMoeBlock; DeepSeek-V3, GLM-4.5: ...MoE (DeepseekV3MoE, Glm4MoeMoE);
    # DeepSeek-V2 in transformers 5: DeepseekV2Moe (only where no other name matches).
    classes = [n for n in dir(mod) if isinstance(getattr(mod, n), type)]
    names = [n for n in classes if n.endswith("SparseMoeBlock") or n.endswith("MoE")]
    names = names or [n for n in classes if n.endswith("Moe")]
    if not names:
        raise RuntimeError(f"no MoE block class in {mod.__name__}")
    return getattr(mod, sorted(names, key=len)[0])


def fill_block(block, prefix, tensors, dense, mixtral):
    """Loads block's parameters from the checkpoint (per-expert or fused transformers layouts)."""
    alias = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"} if mixtral else {}
    sd = block.state_dict()
    new = {}
    experts = sorted({int(k[len(prefix) + 8:].split(".")[0]) for k in dense if k.startswith(prefix + "experts.")})

    def expert(e, which):
        return dense[f"{prefix}experts.{e}.{alias.get(which, which)}"]

    for key, ref in sd.items():
        full = prefix + key
        if full in tensors and full not in dense and not key.endswith(".weight"):
            val = tensors[full].double()                                 # e_score_correction_bias
        elif full in tensors and key.endswith(".weight") and full[:-7] in dense:
            val = dense[full[:-7]]
        elif full.endswith(".weight") and full[:-7] in dense:
            val = dense[full[:-7]]
        elif key.endswith("gate_up_proj") or key.endswith("gate_up_proj.weight"):
            val = torch.stack([torch.cat([expert(e, "gate_proj"), expert(e, "up_proj")], 0) for e in experts])
        elif key.endswith("experts.down_proj") or key.endswith("experts.down_proj.weight"):
            val = torch.stack([expert(e, "down_proj") for e in experts])
        elif full in tensors:
            val = tensors[full].double()
        else:
            raise RuntimeError(f"cannot fill {key} {tuple(ref.shape)} from the checkpoint")
        if tuple(val.shape) != tuple(ref.shape):
            if val.dim() == 3 and tuple(val.transpose(1, 2).shape) == tuple(ref.shape):
                val = val.transpose(1, 2)
            elif val.numel() == ref.numel():
                val = val.reshape(ref.shape)
            else:
                raise RuntimeError(f"{key}: checkpoint gives {tuple(val.shape)}, block wants {tuple(ref.shape)}")
        new[key] = val.to(ref.dtype)
    block.load_state_dict(new)


def hf_reference(d, arch, layer, x):
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(d)
    assert cfg.model_type == arch, cfg.model_type
    cfg._attn_implementation = "eager"
    qcfg = json.load(open(os.path.join(d, "config.json")))["quantization_config"]
    tensors, shards = load_checkpoint(d)
    dense = dense_weights(tensors, qcfg)
    prefix = f"model.layers.{layer}." + ("block_sparse_moe." if arch == "mixtral" else "mlp.")
    cls = moe_block_class(arch)
    torch.set_default_dtype(torch.float64)
    try:
        block = cls(cfg).double().eval()
    finally:
        torch.set_default_dtype(torch.float32)
    fill_block(block, prefix, tensors, dense, arch == "mixtral")
    with torch.no_grad():
        y = block(x.double().unsqueeze(0))
    if isinstance(y, tuple):
        y = y[0]
    return y.reshape(x.shape), shards, cls.__name__


def rel_error(a, b):
    return float(torch.linalg.norm((a - b).flatten()) / torch.linalg.norm(b.flatten()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cli")
    ap.add_argument("work")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seeds", default=None)
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    import transformers
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    ok_all = True
    rows = []
    for arch in ARCHS:
        for label, flags in VARIANTS:
            n = len(rows)
            d = os.path.join(a.work, f"{arch}-{n}")
            x_path = os.path.join(a.work, f"{arch}-{n}.x.safetensors")
            row = {"arch": arch, "format": label}
            try:
                subprocess.run([a.cli, "synth", d, "--arch", arch, *flags, "--example-input", x_path, "--tokens", "33"],
                               check=True, capture_output=True, text=True)
                x = load_file(x_path)["hidden_states"]
                ref, shards, cls = hf_reference(d, arch, 1, x)
                row["reader"] = f"ok ({shards} files)"
                row["block"] = cls
                for dev in a.device.split(","):
                    y_path = os.path.join(a.work, f"{arch}-{n}.{dev}.y.safetensors")
                    r = subprocess.run([a.cli, "run", d, "--layer", "1", "--input", x_path, "--output", y_path,
                                        "--device", dev], capture_output=True, text=True)
                    if r.returncode != 0:
                        raise RuntimeError(f"wna16 run --device {dev}: {r.stderr.strip()}")
                    y = load_file(y_path)["hidden_states"].double()
                    e = rel_error(y, ref)
                    row[dev] = e
                    row["ok"] = row.get("ok", True) and e <= TOLERANCE
            except Exception as ex:  # noqa: BLE001 - report and continue with the next row
                row["ok"] = False
                row["error"] = f"{type(ex).__name__}: {ex}"
                traceback.print_exc()
            ok_all &= row["ok"]
            rows.append(row)
    devs = a.device.split(",")
    print("\n| arch | format | reference reader | transformers block | " +
          " | ".join(f"wna16 {d} vs transformers (rel_error)" for d in devs) + " | result |")
    print("|---|---|---|---|" + "---|" * len(devs) + "---|")
    for r in rows:
        errs = " | ".join(f"{r[d]:.3e}" if d in r else "n/a" for d in devs)
        print(f"| {r['arch']} | {r['format']} | {r.get('reader', 'n/a')} | {r.get('block', 'n/a')} | {errs} | "
              f"{'PASSED' if r['ok'] else 'FAILED ' + r.get('error', '')[:160]} |")
    print(f"{sum(r['ok'] for r in rows)}/{len(rows)} rows passed (tolerance {TOLERANCE})")

    if a.seeds:
        print("\nreference safetensors reader on the fuzz seeds (broken_* must be rejected):")
        for f in sorted(os.listdir(a.seeds)):
            p = os.path.join(a.seeds, f)
            try:
                with safe_open(p, framework="pt") as h:
                    list(h.keys())
                verdict = "accepted"
            except Exception as ex:  # noqa: BLE001
                verdict = f"rejected ({type(ex).__name__}: {str(ex)[:80]})"
            want = "rejected" if f.startswith("broken_") else "accepted"
            same = verdict.startswith(want)
            ok_all &= same
            print(f"  {f:40s} {verdict:100s} {'as wna16' if same else 'DIFFERS from wna16'}")
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
