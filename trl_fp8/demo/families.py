"""Tiny random models of many transformers families (every linear dim a multiple of 128, vocabulary 128 as the demo
tokenizer's), built in-process from their configs, for `tests/test_architectures.py` and `benchmarks/families.py`;
no Hub. `FAMILIES` train under TRL's GRPOTrainer; `LAYERS_ONLY` are built for their layers."""

import torch
import transformers


TINY = dict(
    vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, max_position_embeddings=64, tie_word_embeddings=False,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
UNSET = object()  # a TINY field left out of a family's config
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256)
HYBRID = dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])  # Gated DeltaNet + attention
GEMMA4 = dict(
    num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "full_attention"], sliding_window=16,
    hidden_size_per_layer_input=128, vocab_size_per_layer_input=128, num_kv_shared_layers=1, use_double_wide_mlp=True,
    attention_k_eq_v=True,
)  # fmt: skip
# Gemma 3n (as gemma-3n-E2B: AltUp, LAuReL, per-layer inputs, KV sharing, the LM head tied to the embeddings, as
# vLLM's class holds it) in 3 layers, the last reading layer 1's K/V.
GEMMA3N = dict(
    num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "full_attention"], sliding_window=16,
    hidden_size_per_layer_input=128, vocab_size_per_layer_input=128, laurel_rank=128, num_kv_shared_layers=1,
    activation_sparsity_pattern=[0.0] * 3, tie_word_embeddings=True,
)  # fmt: skip
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", HYBRID),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", MOE | HYBRID),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", MOE | HYBRID),  # q, k, v and z fused on disk
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(final_logit_softcapping=30.0, attn_logit_softcapping=50.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(sliding_window=16)),
    # Gemma 4's per-layer inputs, a last layer reading the K/V of the one before (its MLP double-wide, as in
    # gemma-4-E2B) and full-attention layers whose values are their keys (attention_k_eq_v, as in gemma-4-31B).
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM", GEMMA4),
    "gemma3n": ("Gemma3nTextConfig", "Gemma3nForCausalLM", GEMMA3N),
    # OLMo 1.7 (OLMo-7B-0424, -0724) clips q, k and v in place at 8: `clamp_` on the q/k/v linears' outputs. No GQA,
    # as in OLMo, whose vLLM class has none.
    "olmo": ("OlmoConfig", "OlmoForCausalLM", dict(clip_qkv=8.0, num_key_value_heads=4)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {}),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {}),  # gate and up fused on disk, as in Phi-3
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {}),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", {}),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", {}),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", {}),
    "phi": ("PhiConfig", "PhiForCausalLM", {}),
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", {}),  # short convolutions between the linears
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    # q/k/v interleaved per head in one `query_key_value`; heads of 128 keep vLLM's re-ordering on the block grid.
    # GPT-NeoX has no GQA, and a real config no `num_key_value_heads` (`UNSET`): TINY's 2 left in it made vLLM >= 0.32,
    # which serves GPT-NeoX through its Transformers backend and reads that field, run 2 KV heads where the model has 4
    # (and a null in config.json fails vLLM 0.32's config validation).
    "gpt_neox": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(hidden_size=512, head_dim=128, num_key_value_heads=UNSET),
    ),
}
V4 = dict(
    moe_intermediate_size=256, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, num_key_value_heads=1,
    head_dim=128, q_lora_rank=128, o_lora_rank=128, o_groups=2, index_n_heads=2, index_head_dim=64, index_topk=16,
    qk_rope_head_dim=64, sliding_window=16, num_nextn_predict_layers=0,
)  # fmt: skip
HY_V4 = dict(
    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=256, num_key_value_heads=4, q_lora_rank=128,
    kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, index_n_heads=2, index_head_dim=64,
    index_topk=16, mlp_layer_types=["dense", "sparse"], layer_types=None, indexer_types=["full", "shared"],
)  # fmt: skip
# Built for their layers only: TRL's GRPOTrainer does not train DeepSeek-V4 yet (its config has no `num_experts` for
# TRL's load-balancing loss), HY-V4's sparse-attention indexer gets no gradient from GRPO's loss (in BF16 too), so
# the sweep's "every FP8 weight trains" does not hold for it, and Llama 4 is there for its experts' layout.
LAYERS_ONLY = {
    "deepseek_v4": ("DeepseekV4Config", "DeepseekV4ForCausalLM", V4),
    "hy_v4": ("HYV4Config", "HYV4ForCausalLM", HY_V4),
    "llama4": (
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size=256, interleave_moe_layer_step=1),
    ),
}


def available(family: str) -> bool:
    """Whether the installed transformers has `family` (the newest families arrived after the oldest version
    trl-fp8 supports)."""
    config_class, model_class, _ = (FAMILIES | LAYERS_ONLY)[family]
    return hasattr(transformers, config_class) and hasattr(transformers, model_class)


def tiny(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A seeded tiny model of `family` (a key of `FAMILIES` or `LAYERS_ONLY`), its config updated by `overrides`."""
    config_class, model_class, extra = (FAMILIES | LAYERS_ONLY)[family]
    torch.manual_seed(seed)
    fields = {k: v for k, v in (TINY | extra | overrides).items() if v is not UNSET}
    config = getattr(transformers, config_class)(**fields)
    model = getattr(transformers, model_class)(config)
    # Gemma 3n initializes AltUp's output scale to zero, which silences its per-layer-input branch (no output, no
    # gradient); trained checkpoints hold values around 1 there.
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "correct_output_scale", None), torch.nn.Parameter):
                module.correct_output_scale.fill_(1.0)
    return model


def varied_reward(completions: list[str], **kwargs) -> list[float]:
    """Differs between almost any two completions, so that every group has advantages to learn from."""
    return [sum(map(ord, c)) % 17 / 17 for c in completions]
