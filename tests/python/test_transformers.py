"""wna16.transformers on transformers 5 models: for each of the five families, a tiny random model
built from a config, its routed experts quantized here (round to nearest, 4-bit GPTQ g64 sym and
AWQ g64 asym, packed in the checkpoint layouts of formats.md), run twice: with its experts modules
replaced by wna16's (replace_experts on the checkpoint-layout tensors) and with transformers' own
modules on the same weights dequantized (conftest.dequantize, independent of the library). Checked
over 32 greedily generated tokens from a fixed prompt: logits within 2e-2 relative error at every
position (teacher-forced on the reference's tokens) whose tokens both models routed to the same
experts in every layer (the routers are transformers' own in both: a near-tie between two
experts' scores can go either way under bf16 rounding upstream, and such positions must stay
rare), and the same greedy token wherever the reference's top-2 margin exceeds 1e-2. Skipped where
transformers 5 is not installed (CI)."""
import copy

import pytest
import torch

import wna16
from conftest import dequantize, quantize_rtn

transformers = pytest.importorskip("transformers", reason="needs transformers (the GPU machine has it; CI does not)")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip(f"needs transformers 5 (routed-experts modules); found {transformers.__version__}",
                allow_module_level=True)
import wna16.transformers as wt  # noqa: E402

_COMMON = dict(vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
_DEEPSEEK = dict(num_key_value_heads=4, moe_intermediate_size=64, n_routed_experts=8, n_shared_experts=1,
                 num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=32, qk_rope_head_dim=16,
                 v_head_dim=32, qk_nope_head_dim=16, norm_topk_prob=True)
FAMILIES = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(moe_intermediate_size=64, shared_expert_intermediate_size=128, num_experts=8,
                                         num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[])),
    "qwen3_moe": ("Qwen3MoeConfig", dict(moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2, head_dim=32,
                                         norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])),
    "deepseek_v2": ("DeepseekV2Config", dict(_DEEPSEEK, q_lora_rank=None, n_group=1, topk_group=1)),
    "deepseek_v3": ("DeepseekV3Config", dict(_DEEPSEEK, q_lora_rank=48, n_group=2, topk_group=1,
                                             routed_scaling_factor=2.5)),
}
GROUP = 64
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def tiny_model(family, seed=0):
    cls, kw = FAMILIES[family]
    cfg = getattr(transformers, cls)(**{**_COMMON, **kw})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def quantized_pair(family, fmt, device):
    """(reference model on dequantized experts, wna16 model), both bf16 on device."""
    ref = tiny_model(family)
    tensors, modules = {}, []
    with torch.no_grad():
        for path, m in ref.named_modules():
            if not wt.is_experts(m):
                continue
            E, two_i, _ = m.gate_up_proj.shape
            inter = two_i // 2
            for e in range(E):
                for name, w, rows in (("gate_proj", m.gate_up_proj[e], slice(0, inter)),
                                      ("up_proj", m.gate_up_proj[e], slice(inter, two_i)),
                                      ("down_proj", m.down_proj[e], slice(None))):
                    lin = quantize_rtn(w[rows].float(), fmt, GROUP)
                    for k, v in lin.items():
                        tensors[f"{path}.{e}.{name}.{k}"] = v
                    deq = dequantize(lin, fmt, 4, GROUP).t()  # [N, K]
                    w[rows] = deq.to(w.dtype)
            modules.append(path)
    assert modules, f"{family}: no routed-experts module found"
    ref = ref.to(device=device, dtype=torch.bfloat16)
    mine = copy.deepcopy(ref)
    qc = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "sym": True, "desc_act": False} if fmt == "gptq" \
        else {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
    replaced = wt.replace_experts(mine, tensors, qc)
    assert replaced == modules, (replaced, modules)
    assert all(isinstance(mine.get_submodule(p), wt.Wna16Experts) for p in replaced)
    return ref, mine


def logits_and_routing(model, seq):
    """Teacher-forced logits [T, vocab] and, per experts module, the sorted expert ids [T, k] its
    tokens were routed to (the top_k_index the block passed in)."""
    routes, hooks = {}, []

    def grab(path):
        def hook(mod, args, kwargs):
            idx = args[1] if len(args) > 1 else kwargs["top_k_index"]
            routes[path] = idx.reshape(seq.shape[1], -1).sort(-1).values.cpu()
        return hook

    for path, m in model.named_modules():
        if isinstance(m, wt.Wna16Experts) or wt.is_experts(m):
            hooks.append(m.register_forward_pre_hook(grab(path), with_kwargs=True))
    try:
        with torch.no_grad():
            logits = model(seq, use_cache=False).logits[0].double()
    finally:
        for h in hooks:
            h.remove()
    return logits, routes


def greedy(model, prompt, steps):
    ids = prompt.clone()
    for _ in range(steps):
        with torch.no_grad():
            nxt = model(ids, use_cache=False).logits[:, -1].float().argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], 1)
    return ids


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["gptq", "awq"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_model_with_wna16_experts_matches_transformers(family, fmt, device):
    ref, mine = quantized_pair(family, fmt, device)
    prompt = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(1)).to(device)
    steps = 32
    seq_ref = greedy(ref, prompt, steps)
    lr, routes_ref = logits_and_routing(ref, seq_ref)
    lm, routes_mine = logits_and_routing(mine, seq_ref)
    assert routes_ref and sorted(routes_ref) == sorted(routes_mine), (sorted(routes_ref), sorted(routes_mine))
    flipped = torch.zeros(seq_ref.shape[1], dtype=torch.bool)
    for path, r in routes_ref.items():
        flipped |= (r != routes_mine[path]).any(-1)
    err = ((lm - lr).norm(dim=-1) / lr.norm(dim=-1)).cpu()
    where = f"{family} {fmt} {device}"
    assert int(flipped.sum()) <= seq_ref.shape[1] // 10, f"{where}: routing differs at positions {flipped.nonzero().flatten().tolist()}"
    same = err.masked_fill(flipped, 0.0)
    assert float(same.max()) < 2e-2, (f"{where}: logits relative error {float(same.max()):.3e} at position "
                                      f"{int(same.argmax())} (same routing there; routing differs at "
                                      f"{flipped.nonzero().flatten().tolist()})")
    seq_mine = greedy(mine, prompt, steps)
    top2 = lr.topk(2, dim=-1).values
    margin = (top2[:, 0] - top2[:, 1]).cpu()
    start = prompt.shape[1]
    for t in range(start, start + steps):
        if not torch.equal(seq_mine[0, :t], seq_ref[0, :t]):
            break  # diverged earlier at a near-tie: later tokens continue different texts
        if margin[t - 1] > 1e-2:
            assert int(seq_mine[0, t]) == int(seq_ref[0, t]), (
                f"{family} {fmt} {device}: greedy token {t - start} differs ({int(seq_mine[0, t])} vs "
                f"{int(seq_ref[0, t])}) where the reference's top-2 margin is {float(margin[t - 1]):.3e}")


def test_missing_expert_tensors_name_the_module():
    model = tiny_model("qwen3_moe")
    with pytest.raises(ValueError, match=r"no quantized tensors for expert 0 of 'model\.layers\.0\.mlp\.experts'"):
        wt.replace_experts(model, {}, {"quant_method": "gptq", "bits": 4, "group_size": 64})
    with pytest.raises(ValueError, match="quant_method 'fp8' is not supported"):
        wt.replace_experts(model, {}, {"quant_method": "fp8"})
