"""torch.compile(fullgraph=True) of modules that call torch.ops.wna16: the compiled module gives the
eager module's output bit for bit (the same kernels run), with the weights object as a module
attribute and as an argument, for moe, moe_out and moe_layer, on the CPU (aot_eager) and on CUDA
(inductor). The weights object is traced as itself (MoeWeights.tracing_mode() is "real") and guarded
through __obj_flatten__. Skipped where torch has no torch.compile for custom classes (< 2.4)."""
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
        assert torch.equal(compiled(x, ids, wts), eager(x, ids, wts)), f"{device} M={M}"


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_moe_out_with_weights_as_argument(layer_of, device):  # noqa: F811
    L = layer_of("gptq_asym")
    W = packed(L, device)
    torch._dynamo.reset()
    x, ids, wts = inputs(L, 9, device, 7)
    out_e, out_c = torch.empty_like(x), torch.empty_like(x)
    want = MoeArg()(x, ids, wts, W, out_e)
    got = torch.compile(MoeArg(), fullgraph=True, backend=BACKEND[device])(x, ids, wts, W, out_c)
    assert torch.equal(got, want) and torch.equal(out_c, out_e)


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_moe_layer_gives_the_eager_output(layer_of, device):  # noqa: F811
    L = layer_of("awq")
    W = packed(L, device)
    torch._dynamo.reset()
    f = lambda x: torch.ops.wna16.moe_layer(x, W)  # noqa: E731
    x, _, _ = inputs(L, 33, device, 11)
    assert torch.equal(torch.compile(f, fullgraph=True, backend=BACKEND[device])(x), f(x))
    layer = wna16.MoeLayer(W)  # the nn.Module, on [B, T, hidden]
    xb = x.reshape(3, 11, -1)
    assert torch.equal(torch.compile(layer, fullgraph=True, backend=BACKEND[device])(xb), layer(xb))

