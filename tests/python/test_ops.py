"""torch.ops.wna16 on the CPU against a pure-torch float64 reference built from the
checkpoint-layout tensors (dequantized in the test, per formats.md), with the library's
layer_tolerance; plus the out= variant, the Meta kernels, and the refusals of bad input."""
import pickle
import re

import pytest
import torch

import wna16
from conftest import dequantize, moe_reference, read_checkpoint, rel_error

# (name, synth format, bits, group size, synth flags): GPTQ sym/asym, act-order, v2, AWQ, int8.
SCHEMES = [
    ("gptq_sym", "gptq", 4, 32, ("--group-size", "32")),
    ("gptq_asym", "gptq", 4, 32, ("--group-size", "32", "--asym")),
    ("gptq_actorder", "gptq", 4, 64, ("--group-size", "64", "--desc-act")),
    ("gptq_v2_asym", "gptq_v2", 4, 32, ("--group-size", "32", "--asym")),
    ("awq", "awq", 4, 32, ("--group-size", "32")),
    ("gptq_int8", "gptq", 8, 64, ("--bits", "8", "--group-size", "64")),
]
LAYER = 0  # qwen2_moe synth: every layer is MoE; layer 0 has a sigmoid-gated shared expert
PREFIX = f"model.layers.{LAYER}.mlp."
PROJ = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def linear(t, module):
    lin = {k: t[f"{module}.{k}"] for k in ("qweight", "scales", "qzeros")}
    if f"{module}.g_idx" in t:
        lin["g_idx"] = t[f"{module}.g_idx"]
    return lin


class Layer:
    """The checkpoint tensors of one qwen2_moe layer, packed, and their float64 dequantization."""

    def __init__(self, d, fmt, bits, group, sym, desc_act):
        t = read_checkpoint(d)
        E = 1 + max(int(k.split(".")[5]) for k in t if k.startswith(PREFIX + "experts."))
        self.experts = [{n: linear(t, f"{PREFIX}experts.{e}.{p}") for n, p in PROJ.items()} for e in range(E)]
        self.shared = {n: linear(t, f"{PREFIX}shared_expert.{p}") for n, p in PROJ.items()}
        self.router = t[PREFIX + "gate.weight"]
        self.shared_gate = t[PREFIX + "shared_expert_gate.weight"].reshape(-1)
        self.H = self.router.shape[1]
        self.inter = self.experts[0]["gate"]["scales"].shape[1]  # scales [G, N]: N = inter
        self.fmt, self.bits, self.group = fmt, bits, group
        kw = dict(format=fmt, bits=bits, group_size=group, hidden=self.H, inter=self.inter, top_k=2,
                  sym=sym, desc_act=desc_act)
        self.kw = kw
        # qwen2_moe synth (Qwen1.5-MoE): softmax top-k without renormalisation
        self.weights = wna16.pack(self.experts, router=self.router, renormalize=False, shared=self.shared,
                                  shared_gate=self.shared_gate, **kw)
        deq = lambda lin: dequantize(lin, fmt, bits, group)  # noqa: E731
        self.experts64 = [{n: deq(lin) for n, lin in ex.items()} for ex in self.experts]
        self.shared64 = {n: deq(lin) for n, lin in self.shared.items()}

    def reference(self, x, ids, wts):
        return moe_reference(x.to(torch.float64), ids, wts, self.experts64, self.shared64, self.shared_gate)


_layers = {}


@pytest.fixture
def layer_of(synth):
    def get(name):
        if name not in _layers:
            _, fmt, bits, group, flags = next(s for s in SCHEMES if s[0] == name)
            d = synth("qwen2_moe", fmt, *flags)
            sym = fmt != "awq" and "--asym" not in flags  # AWQ always stores zero points
            _layers[name] = Layer(d, fmt, bits, group, sym, "--desc-act" in flags)
        return _layers[name]
    return get


def routing(M, E, k, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)]).to(torch.int32)
    wts = torch.rand(M, k, generator=g) + 0.1
    return ids, wts / wts.sum(1, keepdim=True)


def activations(M, H, dtype, seed):
    return torch.randn(M, H, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("M", [1, 7, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("scheme", [s[0] for s in SCHEMES])
def test_moe_matches_float64_reference(layer_of, scheme, dtype, M):
    L = layer_of(scheme)
    x = activations(M, L.H, dtype, seed=M)
    ids, wts = routing(M, len(L.experts), 2, seed=M + 1)
    y = wna16.moe(x, ids, wts, L.weights)
    assert y.dtype == dtype and y.shape == x.shape
    err = rel_error(y, L.reference(x, ids, wts))
    assert err <= wna16.layer_tolerance(dtype), f"{scheme} {dtype} M={M}: rel error {err}"


def test_layer_tolerance_is_the_librarys():
    # backend.h layer_tolerance: bf16 1.5e-2, fp16 3e-3 (float32 inputs are computed in bf16).
    assert wna16.layer_tolerance(torch.bfloat16) == 1.5e-2
    assert wna16.layer_tolerance(torch.float16) == 3e-3
    assert wna16.layer_tolerance(torch.float32) == 1.5e-2


def test_moe_out_int64_ids_and_float32(layer_of):
    L = layer_of("gptq_asym")
    x = activations(7, L.H, torch.bfloat16, seed=3)
    ids, wts = routing(7, len(L.experts), 2, seed=4)
    y = wna16.moe(x, ids, wts, L.weights)
    out = torch.full_like(x, float("nan"))
    assert wna16.moe(x, ids, wts, L.weights, out=out) is out
    assert torch.equal(out, y)
    assert torch.equal(wna16.moe(x, ids.to(torch.int64), wts.to(torch.float64), L.weights), y)
    # float32 is computed in bf16, as `wna16 run` does: the same values as the bf16 call.
    y32 = wna16.moe(x.float(), ids, wts, L.weights)
    assert y32.dtype == torch.float32 and torch.equal(y32, y.float())
    out32 = torch.empty(7, L.H)
    wna16.moe(x.float(), ids, wts, L.weights, out=out32)
    assert torch.equal(out32, y32)
    # M = 0, a top_k other than the layer's, and a non-contiguous x
    assert wna16.moe(x[:0], ids[:0], wts[:0], L.weights).shape == (0, L.H)
    ids3, wts3 = routing(7, len(L.experts), 3, seed=5)
    err = rel_error(wna16.moe(x, ids3, wts3, L.weights), L.reference(x, ids3, wts3))
    assert err <= wna16.layer_tolerance(torch.bfloat16)
    xt = x.t().contiguous().t()
    assert not xt.is_contiguous() and torch.equal(wna16.moe(xt, ids, wts, L.weights), y)


def test_moe_layer_routes_like_the_reference(layer_of):
    L = layer_of("gptq_sym")
    x = activations(7, L.H, torch.bfloat16, seed=9)
    logits = x.to(torch.float64) @ L.router.to(torch.float64).t()
    p = torch.softmax(logits, dim=1)
    wts, ids = torch.topk(p, 2, dim=1)  # qwen2_moe synth: norm_topk_prob false, no renormalisation
    y = wna16.moe_layer(x, L.weights)
    err = rel_error(y, L.reference(x, ids, wts))
    assert err <= wna16.layer_tolerance(torch.bfloat16), f"rel error {err}"
    assert torch.equal(wna16.MoeLayer(L.weights)(x.reshape(1, 7, -1)), y.reshape(1, 7, -1))


def test_meta_kernels_infer_shapes(layer_of):
    L = layer_of("gptq_sym")
    x = torch.empty(5, L.H, dtype=torch.float16, device="meta")
    ids = torch.empty(5, 2, dtype=torch.int32, device="meta")
    wts = torch.empty(5, 2, device="meta")
    y = torch.ops.wna16.moe(x, ids, wts, L.weights)
    assert y.device.type == "meta" and y.shape == (5, L.H) and y.dtype == torch.float16
    y = torch.ops.wna16.moe_layer(x, L.weights)
    assert y.device.type == "meta" and y.shape == (5, L.H)
    with pytest.raises(ValueError, match=r"x has shape \[5, 3\]"):
        torch.ops.wna16.moe(torch.empty(5, 3, device="meta"), ids, wts, L.weights)


def test_weights_object(layer_of):
    L = layer_of("awq")
    w = L.weights
    assert (w.hidden(), w.num_experts(), w.top_k(), w.device(), w.has_router()) == (L.H, len(L.experts), 2, "cpu", True)
    assert "awq 4-bit" in w.describe()
    # Equality is identity (torch.compile's fake-tensor dispatch cache compares its arguments with ==).
    other = wna16.pack(L.experts, router=L.router, renormalize=False, shared=L.shared, shared_gate=L.shared_gate, **L.kw)
    assert w == w and not (w == other)
    # Not serialisable: a TypeError (torch.compile's code generation treats it as "cannot pickle").
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(w)


def test_batch_invariant_mode(layer_of):
    # Each token's output bits independent of the rest of its batch (the CPU backend always is).
    L = layer_of("gptq_sym")
    w = L.weights
    assert w.batch_invariant() is False
    w.set_batch_invariant(True)
    try:
        assert w.batch_invariant() is True
        x = activations(33, L.H, torch.bfloat16, seed=4)
        ids, wts = routing(33, len(L.experts), 2, seed=4)
        y = wna16.moe(x, ids, wts, w)
        for M in (1, 5, 17):
            assert torch.equal(wna16.moe(x[:M], ids[:M], wts[:M], w), y[:M]), f"M={M}"
    finally:
        w.set_batch_invariant(False)


# ---- bad input raises, naming the value ------------------------------------------------------------

def test_bad_activations_and_routing_raise(layer_of):
    L = layer_of("gptq_sym")
    w, H, E = L.weights, L.H, len(L.experts)
    x = activations(4, H, torch.bfloat16, seed=1)
    ids, wts = routing(4, E, 2, seed=2)
    with pytest.raises(TypeError, match="x has dtype Int"):
        wna16.moe(x.to(torch.int32), ids, wts, w)
    with pytest.raises(ValueError, match=r"x is undefined \(None\)"):
        wna16.moe(None, ids, wts, w)
    with pytest.raises(TypeError, match="Int is not an activation dtype"):
        wna16.layer_tolerance(torch.int32)
    with pytest.raises(TypeError, match="topk_weights has dtype Int"):
        wna16.moe(x, ids, wts.to(torch.int32), w)
    with pytest.raises(ValueError, match=r"topk_ids\[0, 1\]=1099511627776 is outside"):
        wna16.moe(x, torch.tensor([[0, 2**40]] * 4), wts, w)
    with pytest.raises(ValueError, match="x is on cpu, topk_ids on meta"):
        wna16.moe(x, ids.to("meta"), wts, w)
    with pytest.raises(ValueError, match=rf"x has shape \[4, {H + 1}\]; expected \[M, {H}\]"):
        wna16.moe(torch.zeros(4, H + 1, dtype=torch.bfloat16), ids, wts, w)
    with pytest.raises(ValueError, match=r"x has shape \[2, 2, 256\]"):
        wna16.moe(x.reshape(2, 2, H), ids, wts, w)
    bad = ids.clone()
    bad[2, 1] = E
    with pytest.raises(ValueError, match=rf"topk_ids\[2, 1\]={E} is outside \[0, {E}\)"):
        wna16.moe(x, bad, wts, w)
    bad[2, 1] = -3
    with pytest.raises(ValueError, match=r"topk_ids\[2, 1\]=-3"):
        wna16.moe(x, bad, wts, w)
    with pytest.raises(TypeError, match="topk_ids has dtype Float"):
        wna16.moe(x, ids.float(), wts, w)
    with pytest.raises(ValueError, match=r"topk_ids has shape \[3, 2\]; expected \[M, top_k\] with M=4"):
        wna16.moe(x, ids[:3], wts, w)
    with pytest.raises(ValueError, match=rf"top_k must be in \[1, {E}\]"):
        wna16.moe(x, torch.zeros(4, E + 1, dtype=torch.int32), torch.ones(4, E + 1), w)
    with pytest.raises(ValueError, match=r"topk_weights has shape \[4, 1\]"):
        wna16.moe(x, ids, wts[:, :1], w)
    nan = wts.clone()
    nan[1, 0] = float("nan")
    with pytest.raises(ValueError, match=r"topk_weights\[1, 0\]=nan is not finite"):
        wna16.moe(x, ids, nan, w)
    with pytest.raises(TypeError, match="out has dtype Half"):
        wna16.moe(x, ids, wts, w, out=torch.empty(4, H, dtype=torch.float16))
    with pytest.raises(ValueError, match="out has shape"):
        wna16.moe(x, ids, wts, w, out=torch.empty(5, H, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="must be contiguous"):
        wna16.moe(x, ids, wts, w, out=torch.empty(H, 4, dtype=torch.bfloat16).t())
    with pytest.raises(ValueError, match="last dimension must be the layer's hidden size"):
        wna16.MoeLayer(w)(torch.zeros(2, 3, 5, dtype=torch.bfloat16))


def test_bad_pack_arguments_raise(layer_of):
    L = layer_of("gptq_sym")
    kw = dict(L.kw)
    with pytest.raises(ValueError, match="format 'gptq_v9'|'gptq_v9'"):
        wna16.pack(L.experts, **{**kw, "format": "gptq_v9"})
    with pytest.raises(ValueError, match="bits"):
        wna16.pack(L.experts, **{**kw, "bits": 5})
    with pytest.raises(ValueError, match="routing 'top2' is unknown"):
        wna16.pack(L.experts, routing="top2", **kw)
    with pytest.raises(ValueError, match=r"router has shape \[3, 3\]"):
        wna16.pack(L.experts, router=torch.zeros(3, 3), **kw)
    broken = [dict(e) for e in L.experts]
    broken[3] = dict(broken[3])
    broken[3]["up"] = dict(broken[3]["up"], qweight=broken[3]["up"]["qweight"][:-1])
    with pytest.raises(ValueError, match="expert 3"):
        wna16.pack(broken, **kw)
    broken[3]["up"] = dict(L.experts[3]["up"], qweight=L.experts[3]["up"]["qweight"].float())
    with pytest.raises(TypeError, match="qweight.* has dtype Float"):
        wna16.pack(broken, **kw)
    broken[3]["up"] = dict(L.experts[3]["up"], qzeros=L.experts[3]["up"]["qzeros"][:, :-1])
    with pytest.raises(ValueError, match="expert 3.up: qzeros has"):
        wna16.pack(broken, **kw)
    g = torch.arange(L.H, dtype=torch.int32) // 32
    g[5] = 999
    broken[3]["up"] = dict(L.experts[3]["up"], g_idx=g)
    with pytest.raises(ValueError, match=r"expert 3.up: g_idx\[5\]=999"):
        wna16.pack(broken, **kw)
    with pytest.raises(ValueError, match="group_size=0"):
        wna16.pack(L.experts, **{**kw, "group_size": 0})
    with pytest.raises(ValueError, match="top_k=9 must be in"):
        wna16.pack(L.experts, **{**kw, "top_k": 9})
    with pytest.raises(ValueError, match="no 'down' linear"):
        wna16.pack([{"gate": L.experts[0]["gate"], "up": L.experts[0]["up"]}], **kw)
    no_router = wna16.pack(L.experts, **kw)
    x = activations(2, L.H, torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match="packed without a router"):
        wna16.moe_layer(x, no_router)
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        wna16.pack(L.experts, device="tpu", **kw)
    # device="cuda": refused by a build without the CUDA backend, or by one without a GPU; where
    # both exist it packs (test_cuda_ops.py runs the CUDA kernels).
    try:
        wna16.pack(L.experts, device="cuda", **kw)
    except ValueError as e:
        assert re.search(r"no CUDA backend|no CUDA GPU is present", str(e)), str(e)
