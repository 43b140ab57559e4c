"""Run the routed experts of a transformers (5.x) MoE model on wna16 from quantized expert weights.

transformers 5 gives every MoE block of Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2 and DeepSeek-V3
an ``experts`` module called as ``experts(hidden_states [T, H], top_k_index [T, k], top_k_weights
[T, k]) -> [T, H]``: the block's router (and its shared expert) around it. :func:`replace_experts`
swaps each such module for a :class:`Wna16Experts` that computes the same sum with ``wna16.moe``
on weights packed once from the checkpoint's GPTQ/AWQ tensors; routing, shared experts, attention
and everything else stay transformers' own.

    tensors = {...}   # "model.layers.1.mlp.experts.0.gate_proj.qweight": tensor, ... (the checkpoint's)
    wna16.transformers.replace_experts(model, tensors, config.quantization_config)
    model.generate(...)

This module imports nothing from transformers: it recognises the expert modules by that calling
convention's attributes, so it works on any model built the same way.
"""
import torch

from . import moe, pack

__all__ = ["Wna16Experts", "is_experts", "replace_experts"]

# The three linears of an expert in checkpoint names: (gate, up, down); Mixtral's original names.
_LINEAR_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


class Wna16Experts(torch.nn.Module):
    """``forward(hidden_states, top_k_index, top_k_weights)``: sum over j of weight[t, j] times
    expert top_k_index[t, j] applied to token t, on wna16 (the packed ``MoeWeights``)."""

    def __init__(self, weights, num_experts, source=""):
        super().__init__()
        self.weights = weights
        self.num_experts = num_experts
        self.source = source

    def forward(self, hidden_states, top_k_index, top_k_weights):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        ids = top_k_index.reshape(x.shape[0], -1)
        wts = top_k_weights.reshape(x.shape[0], -1)  # any float dtype: the op takes it as fp32
        return moe(x, ids, wts, self.weights).reshape(shape)

    def extra_repr(self):
        return f"{self.source}: {self.weights.describe()}"


def _quant_args(qc):
    """(format, bits, group_size, sym, desc_act) of a quantization_config (dict or object)."""
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    method = str(qc.get("quant_method", "")).lower()
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if method == "awq":
        if str(qc.get("version", "gemm")).lower() not in ("gemm", ""):
            raise ValueError(f"wna16.transformers: AWQ version '{qc.get('version')}' is not supported (only GEMM)")
        return "awq", bits, group, not bool(qc.get("zero_point", True)), False
    if method == "gptq":
        fmt = "gptq_v2" if str(qc.get("checkpoint_format", "gptq")).lower() == "gptq_v2" else "gptq"
        return fmt, bits, group, bool(qc.get("sym", True)), bool(qc.get("desc_act", False))
    raise ValueError(f"wna16.transformers: quant_method '{qc.get('quant_method')}' is not supported "
                     "(expected gptq or awq)")


def is_experts(module):
    """A transformers 5 routed-experts module: 3D gate_up_proj / down_proj parameters."""
    gu, dn = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor) and gu.dim() == 3 and dn.dim() == 3


def _candidate_prefixes(path):
    """Checkpoint prefixes of the experts at module path ``path`` (Mixtral checkpoints name the
    block block_sparse_moe where transformers 5 names it mlp)."""
    out = [path + "."]
    if ".mlp.experts" in path:
        out.append(path.replace(".mlp.experts", ".block_sparse_moe.experts") + ".")
    return out


def _expert_tensors(tensors, prefix, e, fmt):
    """{"gate": lin, "up": lin, "down": lin} of expert e under prefix, or None if absent."""
    for names in _LINEAR_NAMES:
        lins = {}
        for role, name in zip(("gate", "up", "down"), names):
            base = f"{prefix}{e}.{name}."
            if base + "qweight" not in tensors:
                break
            lin = {k: tensors[base + k] for k in ("qweight", "scales", "qzeros") if base + k in tensors}
            if fmt != "awq" and base + "g_idx" in tensors:
                lin["g_idx"] = tensors[base + "g_idx"]
            lins[role] = lin
        if len(lins) == 3:
            return lins
    return None


def replace_experts(model, tensors, quantization_config, *, device=None):
    """Replaces every routed-experts module of ``model`` by a :class:`Wna16Experts`.

    tensors: the checkpoint's quantized expert tensors by their checkpoint names
    (``<block>.experts.<e>.{gate_proj,up_proj,down_proj}.{qweight,scales,qzeros[,g_idx]}``, or
    Mixtral's w1/w3/w2), e.g. read with safetensors; quantization_config: the checkpoint's
    (``config.quantization_config``: GPTQ v1/v2 or AWQ GEMM). The weights are packed for
    ``device`` (default: the device of the module's own parameters). The original modules' 3D
    parameters are dropped. Returns the module paths replaced; raises ValueError naming the
    module and tensor when an expert's tensors are missing or disagree with the module's shape.
    """
    fmt, bits, group, sym, desc_act = _quant_args(quantization_config)
    top_k = None
    done = []
    for path, module in list(model.named_modules()):
        if not is_experts(module):
            continue
        top_k = top_k or _top_k(model)
        E, two_i, H = module.gate_up_proj.shape
        inter = two_i // 2
        dev = device if device is not None else module.gate_up_proj.device
        # The checkpoint prefix with the most of this module's experts (all of them, or an error).
        found = [(prefix, [_expert_tensors(tensors, prefix, e, fmt) for e in range(E)])
                 for prefix in _candidate_prefixes(path)]
        prefix, experts = max(found, key=lambda f: sum(x is not None for x in f[1]))
        missing = [e for e, x in enumerate(experts) if x is None]
        if missing:
            raise ValueError(f"wna16.transformers: no quantized tensors for expert {missing[0]} of '{path}' "
                             f"(looked for '{prefix}{missing[0]}.gate_proj.qweight' and the Mixtral names "
                             "w1/w3/w2; the up and down linears too)")
        try:
            weights = pack(experts, format=fmt, bits=bits, group_size=group, hidden=H, inter=inter,
                           top_k=min(top_k, E), sym=sym, desc_act=desc_act, device=str(torch.device(dev).type))
        except (ValueError, RuntimeError) as ex:  # the pack op names the tensor by its index
            raise ValueError(f"wna16.transformers: '{path}' (checkpoint prefix '{prefix}'): {ex}") from ex
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, name, Wna16Experts(weights, E, source=path))
        done.append(path)
    if not done:
        raise ValueError("wna16.transformers: the model has no routed-experts module (transformers 5 experts with "
                         "3D gate_up_proj / down_proj parameters)")
    return done


def _top_k(model):
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "get_text_config", lambda: cfg)() if cfg is not None else None
    for name in ("num_experts_per_tok", "moe_topk", "top_k"):
        v = getattr(cfg, name, None)
        if isinstance(v, int) and v > 0:
            return v
    raise ValueError("wna16.transformers: the model's config has no num_experts_per_tok")

