"""torch.ops.wna16 on CUDA tensors (the library's CudaMoeLayer on PyTorch's stream) against the
pure-torch float64 reference: moe / moe_out over the formats and the kernel table's token ranges,
moe_layer with the layer's own router, CUDA graph capture and replay with new routing, and the
refusals. Skipped without a CUDA build of torch and a GPU; an extension built without CUDA
kernels refuses CUDA tensors naming its build."""
import pytest
import torch

import wna16
from conftest import rel_error
from test_ops import SCHEMES, activations, layer_of, routing  # noqa: F401 (layer_of: fixture)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA build of torch and a GPU")

_cuda = {}


def cuda_weights(L, name):
    """L's tensors packed on the GPU (once per scheme); skips where the build has no CUDA kernels."""
    if name not in _cuda:
        _cuda[name] = wna16.pack(L.experts, router=L.router, renormalize=False, shared=L.shared,
                                 shared_gate=L.shared_gate, device="cuda", **L.kw)
    W = _cuda[name]
    try:
        wna16.moe(torch.zeros(1, L.H, dtype=torch.bfloat16, device="cuda"),
                  torch.zeros(1, 2, dtype=torch.int32, device="cuda"), torch.ones(1, 2, device="cuda"), W)
    except NotImplementedError as e:
        assert "no CUDA kernels" in str(e), str(e)
        pytest.skip(f"this build has no CUDA kernels: {e}")
    return W


# 1 and 7 tokens: the decode kernel; 100 (25 per expert of 8... the synth layer's E): the mid-range
# rows; 600: the prefill row.
@pytest.mark.parametrize("M", [1, 7, 100, 600])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("scheme", [s[0] for s in SCHEMES])
def test_cuda_moe_matches_float64_reference(layer_of, scheme, dtype, M):  # noqa: F811
    L = layer_of(scheme)
    W = cuda_weights(L, scheme)
    x = activations(M, L.H, dtype, seed=M)
    ids, wts = routing(M, len(L.experts), 2, seed=M + 1)
    y = wna16.moe(x.cuda(), ids.cuda(), wts.cuda(), W)
    assert y.is_cuda and y.dtype == dtype and y.shape == x.shape
    err = rel_error(y.cpu(), L.reference(x, ids, wts))
    assert err <= wna16.layer_tolerance(dtype), f"{scheme} {dtype} M={M}: rel error {err}"


def test_cuda_batch_invariant_mode(layer_of):  # noqa: F811
    # Each token's output bits those of the same token in a larger batch, router included.
    L = layer_of("gptq_sym")
    W = cuda_weights(L, "gptq_sym")
    W.set_batch_invariant(True)
    try:
        x = activations(300, L.H, torch.bfloat16, seed=6).cuda()
        y = wna16.moe_layer(x, W)
        for M in (1, 3, 17, 118):
            assert torch.equal(wna16.moe_layer(x[:M], W), y[:M]), f"M={M}"
        assert torch.equal(wna16.moe_layer(x, W), y)  # and run to run
    finally:
        W.set_batch_invariant(False)


def test_cuda_moe_layer_routes_itself(layer_of):  # noqa: F811
    L = layer_of("gptq_sym")
    W = cuda_weights(L, "gptq_sym")
    x = activations(33, L.H, torch.bfloat16, seed=5)
    # Qwen1.5-MoE routing (the synth's qwen2_moe): softmax top-2 without renormalisation.
    probs = torch.softmax(x.to(torch.float64) @ L.router.to(torch.float64).T, dim=-1)
    wts, ids = probs.topk(2, dim=-1)
    y = wna16.moe_layer(x.cuda(), W)
    err = rel_error(y.cpu(), L.reference(x, ids, wts))
    assert err <= wna16.layer_tolerance(torch.bfloat16), f"rel error {err}"


def test_cuda_graph_capture_and_replay(layer_of):  # noqa: F811
    L = layer_of("gptq_asym")
    W = cuda_weights(L, "gptq_asym")
    M = 48
    x = torch.zeros(M, L.H, dtype=torch.bfloat16, device="cuda")
    ids = torch.zeros(M, 2, dtype=torch.int32, device="cuda")
    wts = torch.zeros(M, 2, dtype=torch.float32, device="cuda")
    out = torch.empty_like(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside the capture (first-use set-up)
        wna16.moe(x, ids, wts, W, out=out)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        wna16.moe(x, ids, wts, W, out=out)
    for seed in range(3):
        xh = activations(M, L.H, torch.bfloat16, seed=10 + seed)
        ih, wh = routing(M, len(L.experts), 2, seed=20 + seed)
        x.copy_(xh)
        ids.copy_(ih)
        wts.copy_(wh)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        err = rel_error(out.cpu(), L.reference(xh, ih, wh))
        assert err <= wna16.layer_tolerance(torch.bfloat16), f"replay {seed}: rel error {err}"


def test_cuda_out_float32_and_refusals(layer_of):  # noqa: F811
    L = layer_of("gptq_sym")
    W = cuda_weights(L, "gptq_sym")
    x = activations(9, L.H, torch.float32, seed=7).cuda()
    ids, wts = routing(9, len(L.experts), 2, seed=8)
    ids, wts = ids.to(torch.int64).cuda(), wts.cuda()
    out = torch.empty_like(x)
    assert wna16.moe(x, ids, wts, W, out=out) is out
    ref = L.reference(x.cpu().to(torch.bfloat16), ids.cpu(), wts.cpu())
    assert rel_error(out.cpu(), ref) <= wna16.layer_tolerance(torch.float32)
    with pytest.raises(ValueError, match=r"topk_ids\[0, 1\]=99 is outside"):
        bad = ids.clone()
        bad[0, 1] = 99
        wna16.moe(x, bad, wts, W)
    with pytest.raises(ValueError, match="top_k=3 differs from the layer's top_k=2"):
        wna16.moe(x, torch.zeros(9, 3, dtype=torch.int32, device="cuda"), torch.ones(9, 3, device="cuda"), W)
    with pytest.raises(ValueError, match="packed for cpu"):
        wna16.moe(x, ids, wts, L.weights)
    with pytest.raises(ValueError, match="the CPU kernel takes CPU tensors|packed for cuda"):
        wna16.moe(x.cpu(), ids.cpu(), wts.cpu(), W)
