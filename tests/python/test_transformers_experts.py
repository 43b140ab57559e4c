"""wna16.transformers.replace_experts without transformers: a stand-in model shaped like
transformers 5's (model.layers[i].mlp.experts with 3D gate_up_proj [E, 2I, H] / down_proj [E, H, I],
called as experts(hidden_states, top_k_index, top_k_weights)), its experts quantized by rounding
(GPTQ sym / AWQ asym, checkpoint layouts), replaced, and the replacement compared with the float64
sum over the same tokens' experts on the dequantized weights. Mixtral's checkpoint names
(block_sparse_moe, w1/w3/w2) and the refusals too."""
import copy
import types

import pytest
import torch

import wna16
import wna16.transformers as wt
from conftest import dequantize, quantize_rtn, rel_error

E, H, I, TOP_K, GROUP = 8, 128, 64, 2, 64


class Experts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(E, 2 * I, H, dtype=torch.float64) / H ** 0.5)
        self.down_proj = torch.nn.Parameter(torch.randn(E, H, I, dtype=torch.float64) / I ** 0.5)

    def forward(self, x, idx, wts):  # float64, token by token
        out = torch.zeros(x.shape, dtype=torch.float64)
        for t in range(x.shape[0]):
            for j in range(idx.shape[1]):
                e = int(idx[t, j])
                gu = self.gate_up_proj[e] @ x[t].double()
                h = torch.nn.functional.silu(gu[:I]) * gu[I:]
                out[t] += float(wts[t, j]) * (self.down_proj[e] @ h)
        return out


def stand_in_model(layers=2):
    m = torch.nn.Module()
    m.config = types.SimpleNamespace(num_experts_per_tok=TOP_K)
    m.model = torch.nn.Module()
    m.model.layers = torch.nn.ModuleList()
    for _ in range(layers):
        layer = torch.nn.Module()
        layer.mlp = torch.nn.Module()
        layer.mlp.experts = Experts()
        m.model.layers.append(layer)
    return m


def quantized(model, fmt, mixtral_names=False):
    """Checkpoint tensors of every experts module; the module's weights set to their dequantized values."""
    tensors = {}
    names = ("w1", "w3", "w2") if mixtral_names else ("gate_proj", "up_proj", "down_proj")
    with torch.no_grad():
        for path, mod in model.named_modules():
            if not isinstance(mod, Experts):
                continue
            prefix = path.replace(".mlp.", ".block_sparse_moe.") if mixtral_names else path
            for e in range(E):
                for name, w, rows in ((names[0], mod.gate_up_proj[e], slice(0, I)),
                                      (names[1], mod.gate_up_proj[e], slice(I, 2 * I)),
                                      (names[2], mod.down_proj[e], slice(None))):
                    lin = quantize_rtn(w[rows], fmt, GROUP)
                    tensors.update({f"{prefix}.{e}.{name}.{k}": v for k, v in lin.items()})
                    w[rows] = dequantize(lin, fmt, 4, GROUP).t()
    return tensors


QC = {"gptq": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "sym": True, "desc_act": False},
      "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}}


@pytest.mark.parametrize("fmt,mixtral_names", [("gptq", False), ("awq", False), ("gptq", True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_replaced_experts_match_float64(fmt, mixtral_names, dtype):
    torch.manual_seed(0)
    ref = stand_in_model()
    tensors = quantized(ref, fmt, mixtral_names)
    mine = copy.deepcopy(ref)
    assert wt.replace_experts(mine, tensors, QC[fmt]) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    g = torch.Generator().manual_seed(1)
    for layer in range(2):
        new, old = mine.model.layers[layer].mlp.experts, ref.model.layers[layer].mlp.experts
        assert isinstance(new, wt.Wna16Experts) and "model.layers" in repr(new)
        for M in (1, 7, 64):
            x = torch.randn(M, H, generator=g).to(dtype)
            idx = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(M)])
            wts = torch.rand(M, TOP_K, generator=g).to(dtype)  # the router's dtype, converted inside
            y = new(x, idx, wts)
            assert y.dtype == dtype and y.shape == x.shape
            e = rel_error(y, old(x, idx, wts))
            assert e < wna16.layer_tolerance(dtype), f"layer {layer} M={M}: relative error {e:.3e}"


def test_refusals_name_what_is_wrong():
    model = stand_in_model(1)
    with pytest.raises(ValueError, match=r"no quantized tensors for expert 0 of 'model\.layers\.0\.mlp\.experts'"):
        wt.replace_experts(model, {}, QC["gptq"])
    tensors = quantized(stand_in_model(1), "gptq")
    del tensors["model.layers.0.mlp.experts.5.down_proj.qweight"]
    with pytest.raises(ValueError, match="for expert 5 of"):
        wt.replace_experts(model, tensors, QC["gptq"])
    with pytest.raises(ValueError, match="quant_method 'fp8' is not supported"):
        wt.replace_experts(model, {}, {"quant_method": "fp8"})
    with pytest.raises(ValueError, match="no routed-experts module"):
        wt.replace_experts(torch.nn.Linear(4, 4), {}, QC["gptq"])
    bad = quantized(stand_in_model(1), "gptq")
    bad["model.layers.0.mlp.experts.0.gate_proj.scales"] = bad["model.layers.0.mlp.experts.0.gate_proj.scales"][:1]
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.experts' .*scales"):
        wt.replace_experts(model, bad, QC["gptq"])
