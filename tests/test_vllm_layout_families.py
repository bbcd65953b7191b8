"""vLLM's block-FP8 layout for the families whose attention or fused projections it lays out its own way, all
decidable without vLLM: GPT-NeoX's re-ordered query_key_value, Qwen3.5 / Qwen3-Next gated DeltaNet fusions, Gemma 4's
per-layer head_dim and values-are-keys qkv_proj, and Gemma 3n's nested model and KV-shared q_proj. The generic layout
(fused, TP-sliced tensors filled by the stream; the TP block-shape rule) is in tests/test_vllm_layout.py."""

import pytest
import torch
from conftest import vllm_ready

from trl_fp8 import FP8Recipe, convert_to_fp8, dequantize_blockwise, iter_fp8_state
from trl_fp8.demo.families import available, tiny
from trl_fp8.generation.vllm_fp8 import fp8_llm_kwargs
from trl_fp8.generation.vllm_layout import check_vllm_fp8_layers, vllm_linears, with_nested_renames
from trl_fp8.quant.checkpoint_names import checkpoint_module_names


def gpt_neox(head_dim: int):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    config = GPTNeoXConfig(
        vocab_size=128, hidden_size=4 * head_dim, num_attention_heads=4, intermediate_size=512, num_hidden_layers=2
    )
    return GPTNeoXForCausalLM(config)


def vllm_repack_qkv(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """What vLLM's gpt_neox.py (`_repack_qkv`, 0.22.0 to 0.31.0) does to every tensor named query_key_value."""
    shape = tensor.shape
    return tensor.view((num_heads, 3, -1) + shape[1:]).transpose(0, 1).reshape(shape)


def test_gpt_neox_qkv_keeps_its_grid_through_vllms_reordering_at_head_dim_128():
    model = convert_to_fp8(gpt_neox(head_dim=128))
    assert check_vllm_fp8_layers(model, FP8Recipe()) == []
    stream = dict(iter_fp8_state(model))
    q = stream["gpt_neox.layers.0.attention.query_key_value.weight"]
    s = stream["gpt_neox.layers.0.attention.query_key_value.weight_scale_inv"]
    # Re-ordering the codes and the scales as vLLM does gives the re-ordered weight, value for value.
    assert torch.equal(
        dequantize_blockwise(vllm_repack_qkv(q, 4), vllm_repack_qkv(s, 4), (128, 128)),
        vllm_repack_qkv(dequantize_blockwise(q, s, (128, 128)), 4),
    )


def test_gpt_neox_qkv_with_heads_smaller_than_a_block_is_refused_naming_the_fix():
    model = gpt_neox(head_dim=64)  # Pythia up to 410M
    with pytest.raises(ValueError, match=r"layers.0.attention.query_key_value.*head_dim 64.*modules_to_not_convert"):
        check_vllm_fp8_layers(model, FP8Recipe())
    kept = FP8Recipe(modules_to_not_convert=["attention.query_key_value"])
    assert "gpt_neox.layers.0.attention.query_key_value" in check_vllm_fp8_layers(model, kept)


@pytest.mark.skipif(not available("qwen3_5"), reason="transformers has no Qwen3.5")
def test_qwen3_5_gated_deltanet_as_vllm_fuses_it():
    """vLLM packs in_proj_qkv + in_proj_z into in_proj_qkvz (cut into q, k, v and z) and in_proj_b + in_proj_a into
    in_proj_ba, and gates attention through a q_proj of twice the rows (`qwen3_5.py`, `qwen_gdn_linear_attn.py`)."""
    model = tiny("qwen3_5", head_dim=128)
    kept = check_vllm_fp8_layers(model, FP8Recipe(), tp_size=2)
    assert {"model.layers.0.linear_attn.in_proj_b", "model.layers.0.linear_attn.in_proj_a"} <= set(kept)
    layers = {layer.name: layer for layer in vllm_linears(model, tp_size=2)}
    qkvz = layers["model.layers.0.linear_attn.in_proj_qkvz"]
    assert qkvz.output_partition_sizes == (16 * 128 // 2, 16 * 128 // 2, 32 * 128 // 2, 32 * 128 // 2)
    assert layers["model.layers.1.self_attn.qkv_proj"].output_partition_sizes == (2 * 4 * 128 // 2, 128, 128)
    # vLLM refuses a fused layer whose shards differ in precision ("Detected some but not all shards").
    with pytest.raises(ValueError, match=r"fuses model.layers.0.linear_attn.in_proj_qkvz and needs all its shards"):
        check_vllm_fp8_layers(model, FP8Recipe(modules_to_not_convert=["in_proj_z"]))
    # Two key heads of 64 put 64 rows of q on each of 2 ranks: the part inside in_proj_qkv is named.
    narrow = tiny("qwen3_5", head_dim=128, linear_num_key_heads=2, linear_key_head_dim=64)
    with pytest.raises(ValueError, match=r"the q part of model.layers.0.linear_attn.in_proj_qkvz per rank is 64"):
        check_vllm_fp8_layers(narrow, FP8Recipe(), tp_size=2)


@pytest.mark.skipif(not available("qwen3_next"), reason="transformers has no Qwen3-Next")
def test_qwen3_next_fused_qkvz_splits_over_ranks_as_one_partition():
    """Qwen3-Next stores q, k, v and z in one `in_proj_qkvz`, interleaved by key-head group, which vLLM keeps as one
    output partition: each rank's rows must be whole blocks."""
    model = tiny("qwen3_next", head_dim=128)
    layers = {layer.name: layer for layer in vllm_linears(model, tp_size=2)}
    assert layers["model.layers.0.linear_attn.in_proj_qkvz"].output_partition_sizes == ((2 * 16 + 2 * 32) * 128 // 2,)
    check_vllm_fp8_layers(model, FP8Recipe(), tp_size=2)
    # One key and one value head of 64: (2 * 64 + 2 * 64) rows, 64 on each of 4 ranks (experts kept out of the way).
    narrow = tiny("qwen3_next", head_dim=128, linear_num_key_heads=1, linear_key_head_dim=64, linear_num_value_heads=1,
                  linear_value_head_dim=64)  # fmt: skip
    with pytest.raises(
        ValueError, match=r"qkvz in block FP8 with vllm_tensor_parallel_size=4: output of .* per rank is 64"
    ):
        check_vllm_fp8_layers(narrow, FP8Recipe(modules_to_not_convert=["mlp.experts"]), tp_size=4)


@pytest.mark.skipif(not available("gemma4"), reason="transformers has no Gemma 4")
@pytest.mark.parametrize("tp_size", [1, 2])
def test_attention_rows_come_from_each_layers_own_config(tp_size):
    """Gemma 4's config is heterogeneous: head_dim 64 in the tiny sliding-window layer, 512 in full-attention ones,
    and it refuses `config.head_dim` (transformers' AmbiguousGlobalPerLayerAttributeError, which stopped every
    colocated-vLLM run of Gemma 4 at start). Each layer's q/k/v rows per rank follow its own head_dim."""
    model = tiny("gemma4", attention_k_eq_v=False)
    rows = {x.name: x.output_partition_sizes for x in vllm_linears(model, tp_size) if x.name.endswith("qkv_proj")}
    assert rows == {
        "model.layers.0.self_attn.qkv_proj": (4 * 64 // tp_size, 2 * 64 // tp_size, 2 * 64 // tp_size),
        "model.layers.1.self_attn.qkv_proj": (4 * 512 // tp_size, 2 * 512 // tp_size, 2 * 512 // tp_size),
    }  # layer 2 reads layer 1's K/V: it has no k_proj or v_proj
    if tp_size == 1:
        check_vllm_fp8_layers(convert_to_fp8(model), FP8Recipe(), tp_size)
    else:  # the tiny sliding layer's k, 64 rows per rank, is half a block
        with pytest.raises(ValueError, match=r"layers.0.self_attn.k_proj per rank is 64, not a multiple of 128"):
            check_vllm_fp8_layers(convert_to_fp8(model), FP8Recipe(), tp_size)


# Gemma3nTextModel's `hf_to_vllm_mapper.orig_to_new_prefix` in vLLM 0.31's gemma3n.py (what
# `vllm_nested_prefix_maps(["Gemma3nForCausalLM"])` reads there: tests/test_vllm_end_to_end.py runs the family).
GEMMA3N_TEXT_MODEL_PREFIXES = {
    "embed_tokens.": "self_decoder.embed_tokens.",
    "embed_tokens_per_layer.": "self_decoder.embed_tokens_per_layer.",
    "per_layer_model_projection.": "self_decoder.per_layer_model_projection.",
    "per_layer_projection_norm.": "self_decoder.per_layer_projection_norm.",
    "altup_projections.": "self_decoder.altup_projections.",
}


@pytest.mark.skipif(not available("gemma3n"), reason="transformers has no Gemma 3n")
def test_vllm_ignores_the_high_precision_layers_a_nested_model_moves():
    """vLLM's Gemma 3n text model keeps its AltUp and per-layer-input projections under `self_decoder` and renames
    `ignored_layers` with prefixes relative to itself, so the root names trl-fp8 gave it matched nothing: vLLM built
    those layers in FP8 while the learner keeps them in high precision, and the first refit stopped ("vLLM did not
    load 4 of its parameters ... altup_projections.0.weight_scale_inv"). Their `self_decoder` names are now ignored
    too, beside every name as it was."""
    model = tiny("gemma3n")
    ignored = fp8_llm_kwargs(model, FP8Recipe())["hf_overrides"]["quantization_config"]["ignored_layers"]
    kept = checkpoint_module_names(model, check_vllm_fp8_layers(model, FP8Recipe()), prefixes=False)
    assert "model.altup_projections.0" in kept and "model.per_layer_model_projection" in kept
    renamed = with_nested_renames(kept, [GEMMA3N_TEXT_MODEL_PREFIXES])
    assert renamed[: len(kept)] == kept  # every name as it was, first
    assert sorted(set(renamed) - set(kept)) == [
        "model.self_decoder.altup_projections.0",
        "model.self_decoder.altup_projections.1",
        "model.self_decoder.altup_projections.2",
        "model.self_decoder.per_layer_model_projection",
    ]
    assert with_nested_renames(kept, []) == kept
    if not vllm_ready():  # without vLLM no nested model is read
        assert ignored == kept
    else:
        assert set(renamed) <= set(ignored)


# vLLM 0.31's packed_modules_mapping for Gemma 3n / Gemma 4 (gemma3n.py Gemma3nForCausalLM, gemma4.py
# Gemma4ForCausalLM).
GEMMA_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def _vllm_is_layer_skipped(prefix: str, ignored: set[str]) -> bool:
    """vLLM 0.31's `quant_utils.is_layer_skipped` in Fp8Config's exact mode, restated (vLLM is not installed where
    these tests run): a fused layer is skipped where all its shards are ignored, refused where only some are."""
    leaf = prefix.rsplit(".", 1)[1]
    flags = {prefix.replace(leaf, shard) in ignored for shard in GEMMA_PACKED.get(leaf, [leaf])}
    if len(flags) > 1:
        raise ValueError(f"Detected some but not all shards of {prefix} are quantized.")
    return flags.pop()


@pytest.mark.skipif(not available("gemma4"), reason="transformers has no Gemma 4")
@pytest.mark.parametrize("tp_size", [1, 2])
def test_gemma4_values_are_keys_layer_is_one_qkv_proj_and_the_kv_shared_q_proj_stands_alone(tp_size):
    """tiny("gemma4"): layer 0 sliding (q, k, v), layer 1 full attention with attention_k_eq_v (q, k; vLLM loads k
    into the K and V shards of its qkv_proj), layer 2 KV-shared (q alone: vLLM's plain ColumnParallelLinear q_proj)."""
    model = tiny("gemma4")
    layers = {x.name: x for x in vllm_linears(model, tp_size)}
    qkv = layers["model.layers.1.self_attn.qkv_proj"]
    assert qkv.shards == ("model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj")
    assert qkv.output_partition_sizes == (4 * 512 // tp_size, 2 * 512 // tp_size, 2 * 512 // tp_size)
    assert qkv.aliases == ("model.layers.1.self_attn.v_proj",)
    assert layers["model.layers.2.self_attn.q_proj"].output_partition_sizes == (4 * 512 // tp_size,)
    assert "model.layers.2.self_attn.qkv_proj" not in layers


@pytest.mark.skipif(not available("gemma4"), reason="transformers has no Gemma 4")
def test_gemma4_values_are_keys_layer_needs_q_and_k_in_one_precision():
    model = tiny("gemma4")
    with pytest.raises(ValueError, match=r"fuses model\.layers\.1\.self_attn\.qkv_proj .*k_proj \(high precision\)"):
        check_vllm_fp8_layers(model, FP8Recipe(modules_to_not_convert=["layers.1.self_attn.k_proj"]))


@pytest.mark.skipif(not available("gemma4"), reason="transformers has no Gemma 4")
@pytest.mark.parametrize(
    "recipe",
    [FP8Recipe(num_last_layers_in_bf16=2), FP8Recipe(modules_to_not_convert=["self_attn"])],
    ids=["last_layers_bf16", "attention_bf16"],
)
def test_vllm_accepts_the_ignored_layers_of_a_high_precision_values_are_keys_layer(recipe):
    """`ignored_layers` held layers.1's q_proj and k_proj but no v_proj (the learner has none), and vLLM's
    is_layer_skipped refused layers.1.self_attn.qkv_proj inside LLM(...) ("Detected some but not all shards ...")."""
    model = tiny("gemma4")
    ignored = set(fp8_llm_kwargs(model, recipe)["hf_overrides"]["quantization_config"]["ignored_layers"])
    # the layers vLLM builds a qkv_proj for (layer 2 is KV-shared): no refusal, and layer 1 in high precision
    _vllm_is_layer_skipped("model.layers.0.self_attn.qkv_proj", ignored)
    assert _vllm_is_layer_skipped("model.layers.1.self_attn.qkv_proj", ignored)
    assert _vllm_is_layer_skipped("model.layers.2.self_attn.q_proj", ignored)


@pytest.mark.skipif(not available("gemma3n"), reason="transformers has no Gemma 3n")
def test_gemma3n_kv_shared_q_proj_is_checked_alone():
    model = tiny("gemma3n")  # layer 2 reads layer 1's K/V: q_proj alone
    layers = {x.name: x for x in vllm_linears(model, 4)}
    q = layers["model.layers.2.self_attn.q_proj"]
    assert q.output_partition_sizes == (4 * 64 // 4,)
    assert q.block_shape_error() == "output of model.layers.2.self_attn.q_proj per rank is 64, not a multiple of 128"
