"""Tiny Mixture-of-Experts models (4 experts, top-2, every linear dim a multiple of 128) built in-process, for the MoE
tests and `benchmarks/moe_mismatch.py`; no Hub."""

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from ..recipe import FP8Recipe


def tiny_qwen3_moe(tokenizer=None, seed=0):
    torch.manual_seed(seed)
    ids = {} if tokenizer is None else dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config = Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        **ids,
        moe_intermediate_size=128,
        num_experts=4,
        num_experts_per_tok=2,
    )
    return Qwen3MoeForCausalLM(config)


def tiny_deepseek_v3(tokenizer=None, seed=0, q_lora_rank: int | None = 128):
    torch.manual_seed(seed)
    ids = {} if tokenizer is None else dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config = DeepseekV3Config(
        vocab_size=128,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        n_shared_experts=1,
        first_k_dense_replace=1,  # layer 0 dense, layer 1 MoE
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=q_lora_rank,  # None: a full-rank q_proj, as DeepSeek-V2-Lite
        kv_lora_rank=128,
        qk_rope_head_dim=64,
        qk_nope_head_dim=64,
        v_head_dim=64,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        **ids,
    )
    return DeepseekV3ForCausalLM(config)


# Moonlight keeps MLA's low-rank projections in BF16 (NeMo RL's recipe).
MOONLIGHT_RECIPE = FP8Recipe(modules_to_not_convert=["*a_proj*", "*b_proj*"])  # as recipes/moonlight_16b_a3b_fp8.yaml
