"""torch.compile(fullgraph=True) of modules that call torch.ops.wna16: the compiled module gives the
eager module's output (the same kernels run: bit for bit on the CPU, within eager's own rerun spread
on CUDA), with the weights object as a module attribute and as an argument, for moe, moe_out and
moe_layer, on the CPU (aot_eager) and on CUDA (inductor). The weights object is traced as a fake
object (python/wna16/_fake.py) built from its __obj_flatten__ state, which also guards the compiled
graph. Skipped where torch has no torch.compile for custom classes (< 2.4)."""
import pytest
import torch

import wna16
from test_ops import activations, layer_of, routing  # noqa: F401 (layer_of: fixture)

pytestmark = pytest.mark.skipif(
    not hasattr(torch, "compile") or not hasattr(getattr(torch, "_library", None), "register_fake_class"),
    reason="torch.compile of ops taking custom classes needs torch >= 2.4")

DEVICES = ["cpu", "cuda"]
BACKEND = {"cpu": "aot_eager", "cuda": "inductor"}


class MoeAttr(torch.nn.Module):
    """An engine's layer: the packed weights held by the module."""

    def __init__(self, weights):
        super().__init__()
        self.weights = weights

    def forward(self, x, ids, wts):
        y = torch.ops.wna16.moe(x, ids, wts, self.weights)
        return y * 2 + 1  # something for the compiler to fuse around the op


class MoeArg(torch.nn.Module):
    def forward(self, x, ids, wts, weights, out):
        torch.ops.wna16.moe_out(x, ids, wts, weights, out=out)
        return out.float().sum(dim=-1)


def same(a, b, device):
    """The compiled module's output against eager's: bit for bit on the CPU; on CUDA within one bf16 unit
    in the last place of the output's largest magnitude, the spread of eager's own reruns there (GEMM2
    sums the top-k experts with fp32 atomics in no fixed order, so the CUDA layer is not
    bit-reproducible; a 1-ulp difference of the layer's output survives the module's own arithmetic
    only on that scale)."""
    if device == "cpu":
        return torch.equal(a, b)
    a, b = a.float(), b.float()
    scale = float(b.abs().max()) if b.numel() else 0.0
    return a.shape == b.shape and float((a - b).abs().max()) <= scale * 2.0**-7


def packed(L, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA build of torch and a GPU")
    return wna16.pack(L.experts, router=L.router, renormalize=False, shared=L.shared, shared_gate=L.shared_gate,
                      device=device, **L.kw)


def inputs(L, M, device, seed):
    x = activations(M, L.H, torch.bfloat16, seed=seed).to(device)
    ids, wts = routing(M, len(L.experts), 2, seed=seed + 1)
    return x, ids.to(device), wts.to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_moe_module_gives_the_eager_output(layer_of, device):  # noqa: F811
    L = layer_of("gptq_sym")
    W = packed(L, device)
    torch._dynamo.reset()
    eager = MoeAttr(W)
    compiled = torch.compile(MoeAttr(W), fullgraph=True, backend=BACKEND[device])
    for M, seed in ((17, 1), (17, 2), (40, 3)):  # a second call reuses the graph; a new M may recompile
        x, ids, wts = inputs(L, M, device, seed)
        assert same(compiled(x, ids, wts), eager(x, ids, wts), device), f"{device} M={M}"


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_moe_out_with_weights_as_argument(layer_of, device):  # noqa: F811
    L = layer_of("gptq_asym")
    W = packed(L, device)
    torch._dynamo.reset()
    x, ids, wts = inputs(L, 9, device, 7)
    out_e, out_c = torch.empty_like(x), torch.empty_like(x)
    want = MoeArg()(x, ids, wts, W, out_e)
    got = torch.compile(MoeArg(), fullgraph=True, backend=BACKEND[device])(x, ids, wts, W, out_c)
    assert same(out_c, out_e, device)
    assert torch.equal(got, want) if device == "cpu" else torch.allclose(got, want, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_moe_layer_gives_the_eager_output(layer_of, device):  # noqa: F811
    L = layer_of("awq")
    W = packed(L, device)
    torch._dynamo.reset()
    f = lambda x: torch.ops.wna16.moe_layer(x, W)  # noqa: E731
    x, _, _ = inputs(L, 33, device, 11)
    assert same(torch.compile(f, fullgraph=True, backend=BACKEND[device])(x), f(x), device)
    layer = wna16.MoeLayer(W)  # the nn.Module, on [B, T, hidden]
    xb = x.reshape(3, 11, -1)
    assert same(torch.compile(layer, fullgraph=True, backend=BACKEND[device])(xb), layer(xb), device)

