"""wna16: MoE layers of GPTQ/AWQ-quantized models as PyTorch custom ops (torch.ops.wna16).

The ops run on the wna16 library's backends: CPU tensors on its CPU backend, CUDA tensors on its
CUDA layer (on PyTorch's current stream, capturable in torch.cuda.CUDAGraph; built where Torch
has CUDA, else a CUDA tensor gets an error naming the build). Weights are packed once, into
a ``torch.classes.wna16.MoeWeights`` object, by :func:`pack` (checkpoint-layout tensors) or
:meth:`MoeLayer.from_checkpoint` (a Hugging Face model directory); every call then reuses them.

    weights = wna16.pack(experts, format="gptq", bits=4, group_size=128, hidden=H, inter=I, top_k=2)
    y = wna16.moe(x, topk_ids, topk_weights, weights)      # routing decided by the caller
    y = wna16.moe_layer(x, weights)                          # the layer's own router (router= given)
"""
import os

import torch

torch.ops.load_library(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_C.so"))

from .layer import MoeLayer  # noqa: E402

# torch >= 2.4: shape functions in Python and a fake weights class, for torch.compile (_fake.py).
if hasattr(torch.library, "register_fake") and hasattr(getattr(torch, "_library", None), "register_fake_class"):
    from . import _fake  # noqa: E402

    _fake.register()

MoeWeights = torch.classes.wna16.MoeWeights
ops = torch.ops.wna16

__all__ = ["MoeLayer", "MoeWeights", "pack", "moe", "moe_layer", "layer_tolerance", "ops"]

_LINEARS = ("gate", "up", "down")


def _flatten(experts, shared):
    """Lists of qweight, scales, qzeros, g_idx: gate, up, down per expert, then the shared expert."""
    qweight, scales, qzeros, g_idx = [], [], [], []
    any_g_idx = False
    for e, expert in enumerate(list(experts) + ([shared] if shared is not None else [])):
        for name in _LINEARS:
            if name not in expert:
                raise ValueError(f"wna16.pack: expert {e} has no '{name}' linear (keys: {sorted(expert)})")
            lin = expert[name]
            for key in ("qweight", "scales", "qzeros"):
                if key not in lin or not isinstance(lin[key], torch.Tensor):
                    raise ValueError(f"wna16.pack: expert {e} {name}: '{key}' is missing or not a tensor")
            qweight.append(lin["qweight"])
            scales.append(lin["scales"])
            qzeros.append(lin["qzeros"])
            gi = lin.get("g_idx")
            any_g_idx = any_g_idx or gi is not None
            g_idx.append(gi if gi is not None else torch.empty(0, dtype=torch.int32))
    return qweight, scales, qzeros, (g_idx if any_g_idx else [])


def pack(experts, *, format, bits, group_size, hidden, inter, top_k, sym=True, desc_act=False, router=None,
         routing="softmax_topk", renormalize=True, n_group=1, topk_group=1, routed_scaling_factor=1.0,
         correction_bias=None, shared=None, shared_kind=None, shared_gate=None, device="cpu"):
    """Packs E experts given in checkpoint layout, once, for the backend of ``device``.

    experts: a list of E dicts ``{"gate": lin, "up": lin, "down": lin}``, each ``lin`` a dict of the
    checkpoint's tensors: GPTQ (format "gptq" = v1 or "gptq_v2") ``qweight`` int32 [K*bits/32, N],
    ``scales`` fp16/bf16 [G, N], ``qzeros`` int32 [G, N*bits/32], optional ``g_idx`` int32 [K];
    AWQ ("awq") ``qweight`` int32 [K, N/8] (AWQ's interleave), ``qzeros`` [G, N/8], ``scales``.
    gate/up have K=hidden, N=inter; down has K=inter, N=hidden.
    router: [E, hidden] (needed by moe_layer, not by moe). shared: one more such dict, with
    shared_kind "plain" (DeepSeek) or "sigmoid_gated" (Qwen2-MoE, with shared_gate [hidden]).
    """
    if shared_kind is None:
        shared_kind = "none" if shared is None else ("sigmoid_gated" if shared_gate is not None else "plain")
    shared_inter = 0
    if shared is not None:
        sq = shared["down"]["qweight"]
        shared_inter = sq.shape[0] if format == "awq" else sq.shape[0] * 32 // bits
    qweight, scales, qzeros, g_idx = _flatten(experts, shared)
    return ops.pack(qweight, scales, qzeros, g_idx, format, bits, group_size, sym, desc_act, hidden, inter, top_k,
                    router=router, routing=routing, renormalize=renormalize, n_group=n_group, topk_group=topk_group,
                    routed_scaling_factor=float(routed_scaling_factor), correction_bias=correction_bias,
                    shared_kind=shared_kind, shared_inter=shared_inter, shared_gate=shared_gate, device=device)


def moe(x, topk_ids, topk_weights, weights, out=None):
    """sum_j topk_weights[m, j] * expert[topk_ids[m, j]](x[m]) (+ the shared expert), x [M, hidden].

    x: bfloat16 or float16 (float32 is computed in bfloat16, as ``wna16 run`` does); topk_ids int32
    or int64 [M, k] (k in [1, E], not necessarily the layer's top_k); topk_weights float [M, k].
    Non-contiguous x, ids or weights are copied; ``out`` (a tensor like x to write into) must be
    contiguous. On CUDA, k must be the layer's top_k, and the ids' range is checked (a device-to-host
    copy) except while a CUDA graph is being captured: there an id outside [0, E) adds nothing. The shared expert, if the weights have one, is added as in the whole layer; pack
    without ``shared`` when the caller runs it separately. Inference only: no autograd.
    """
    if out is None:
        return ops.moe(x, topk_ids, topk_weights, weights)
    ops.moe_out(x, topk_ids, topk_weights, weights, out=out)  # returns nothing (a mutating op, for torch.compile)
    return out


def moe_layer(x, weights):
    """The whole MoE layer on x [M, hidden]: the layer's router and routing, experts, shared expert."""
    return ops.moe_layer(x, weights)


def layer_tolerance(dtype):
    """Relative Frobenius error the backends are held to against the float64 reference (backend.h)."""
    return ops.layer_tolerance(dtype)
