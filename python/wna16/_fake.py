"""torch.compile support (torch >= 2.4): the MoeWeights fake class and the ops' fake kernels.

Dynamo traces a module that holds or takes packed weights with a fake object built from the real
one's ``__obj_flatten__`` state (the C++ class, csrc/ops.cpp), and the ops with these shape
functions; on Meta tensors the same functions run. The C++ Meta kernels serve torch < 2.4 only
(the two kinds cannot both be registered). Checks here are those shapes and dtypes need; the real
kernels check everything (values included).
"""
import torch


def _shape(t):
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _check(who, x, weights, ids=None, wts=None):
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{who}: x has dtype {x.dtype}; expected bfloat16, float16 or float32")
    H = weights.hidden()
    if x.dim() != 2 or x.shape[1] != H:
        raise ValueError(f"{who}: x has shape {_shape(x)}; expected [M, {H}] (the layer's hidden size)")
    if ids is None:
        return
    if ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{who}: topk_ids has dtype {ids.dtype}; expected int32 or int64")
    if not wts.dtype.is_floating_point:
        raise TypeError(f"{who}: topk_weights has dtype {wts.dtype}; expected a floating type")
    if ids.device != x.device or wts.device != x.device:
        raise ValueError(f"{who}: x is on {x.device}, topk_ids on {ids.device}, topk_weights on {wts.device}; "
                         "expected one device")
    if ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"{who}: topk_ids has shape {_shape(ids)}; expected [M, top_k] with M={x.shape[0]}")
    if wts.shape != ids.shape:
        raise ValueError(f"{who}: topk_weights has shape {_shape(wts)}; expected {_shape(ids)} (topk_ids' shape)")


class FakeMoeWeights:
    """What tracing sees of a MoeWeights object: its __obj_flatten__ state and its methods."""

    def __init__(self, state):
        self._s = state

    @classmethod
    def __obj_unflatten__(cls, flat):
        return cls(dict(flat))

    def describe(self):
        return self._s["describe"]

    def hidden(self):
        return self._s["hidden"]

    def inter(self):
        return self._s["inter"]

    def num_experts(self):
        return self._s["num_experts"]

    def top_k(self):
        return self._s["top_k"]

    def has_router(self):
        return self._s["has_router"]

    def device(self):
        return self._s["device"]


def register():
    torch._library.register_fake_class("wna16::MoeWeights")(FakeMoeWeights)

    @torch.library.register_fake("wna16::moe")
    def _moe(x, topk_ids, topk_weights, weights):
        _check("wna16.moe", x, weights, topk_ids, topk_weights)
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("wna16::moe_out")
    def _moe_out(x, topk_ids, topk_weights, weights, *, out):
        _check("wna16.moe_out", x, weights, topk_ids, topk_weights)
        if out.dtype != x.dtype or out.shape != x.shape:
            raise ValueError(f"wna16.moe_out: out is {out.dtype} {_shape(out)}; expected x's {x.dtype} {_shape(x)}")

    @torch.library.register_fake("wna16::moe_layer")
    def _moe_layer(x, weights):
        _check("wna16.moe_layer", x, weights)
        return torch.empty_like(x, memory_format=torch.contiguous_format)
