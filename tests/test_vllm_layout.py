"""vLLM's block-FP8 layout against the export stream, all decidable without vLLM: the tensors `Fp8LinearMethod`
allocates (fused, TP-sliced) filled exactly by the stream, the TP block-shape rule naming the layer, MoE routers and
high-precision experts ignored by vLLM and streamed per expert, and a LoRA learner configuring vLLM as the plain
model does."""

import copy
import dataclasses
import math

import pytest
import torch
from conftest import TP_READY, tiny_model
from transformers import LlamaConfig, LlamaForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM

from trl_fp8 import FP8Recipe, convert_to_fp8, iter_fp8_state
from trl_fp8.demo.families import tiny
from trl_fp8.demo.tiny_moe import MOONLIGHT_RECIPE, tiny_deepseek_v3, tiny_qwen3_moe
from trl_fp8.generation.vllm_fp8 import fp8_llm_kwargs, stream_checkpoint_names
from trl_fp8.generation.vllm_layout import check_vllm_fp8_layers, vllm_linears


def _load_like_vllm(stream: dict, layer, rank: int, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What vLLM's loaders put in `layer`'s `weight` / `weight_scale_inv` on `rank`: each shard's rows (column
    parallel) or columns (row parallel) for that rank, concatenated; block scales sliced at the same offsets / 128."""
    weights, scales = [], []
    for shard, rows in zip(layer.shards, layer.output_partition_sizes, strict=True):
        w, s = stream[f"{shard}.weight"], stream[f"{shard}.weight_scale_inv"]
        if layer.input_size_per_partition != layer.input_size:  # row parallel: split K
            k = layer.input_size_per_partition
            w, s = w[:, rank * k : (rank + 1) * k], s[:, rank * k // 128 : (rank + 1) * k // 128]
        else:  # column parallel: this rank's rows (KV heads replicated when fewer than ranks)
            replicas = max(1, tp * rows // w.shape[0])
            start = rank // replicas * rows
            assert start % 128 == 0 or len(layer.shards) == 1 and tp == 1
            w, s = w[start : start + rows], s[start // 128 : math.ceil((start + rows) / 128)]
        weights.append(w)
        scales.append(s)
    return torch.cat(weights), torch.cat(scales)


def _split_fused_on_disk(stream: dict, layer, global_rows: tuple[int, ...]):
    """vLLM's `_load_fused_module_from_checkpoint` for a module fused on the Hugging Face side (Phi-3's qkv_proj):
    its rows cut into the parts at the config's global sizes, its block scales at offset / 128 rounded up; returns the
    parts as stream entries and the layer as if its checkpoint had held them separately."""
    weight, scale = stream[f"{layer.name}.weight"], stream[f"{layer.name}.weight_scale_inv"]
    parts, offset = {}, 0
    for part, rows in zip(layer.parts, global_rows, strict=True):
        parts[f"{part}.weight"] = weight[offset : offset + rows]
        parts[f"{part}.weight_scale_inv"] = scale[math.ceil(offset / 128) :][: math.ceil(rows / 128)]
        offset += rows
    assert offset == weight.shape[0]
    return parts, dataclasses.replace(layer, shards=layer.parts)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize(
    ("config_cls", "model_cls"),
    [(LlamaConfig, LlamaForCausalLM), (Qwen2Config, Qwen2ForCausalLM), (Phi3Config, Phi3ForCausalLM)],
)
def test_export_stream_fills_vllm_block_fp8_parameters(config_cls, model_cls, tp):
    """The stream's per-module pairs compose, through vLLM's fusing and TP slicing, into exactly the `weight` (N, K)
    e4m3 and `weight_scale_inv` (ceil(N/128), ceil(K/128)) fp32 that `Fp8LinearMethod.create_weights` allocates.
    Phi-3 holds q/k/v and gate/up fused already; vLLM cuts them into the same parts while loading."""
    model = tiny_model(config_cls, model_cls, **TP_READY)
    recipe = FP8Recipe()
    check_vllm_fp8_layers(model, recipe, tp)
    convert_to_fp8(model, recipe)
    names = [name for name, _ in iter_fp8_state(model)]
    assert len(names) == len(set(names))  # a name twice (a bias after its weight, say) would fail vLLM's reload
    stream = dict(iter_fp8_state(model))
    layers = vllm_linears(model, tp)
    global_rows = {layer.name: layer.output_partition_sizes for layer in vllm_linears(model, 1)}
    assert {layer.name.rsplit(".", 1)[1] for layer in layers} == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    used = set()
    for layer in layers:
        used |= {f"{s}.{suffix}" for s in layer.shards for suffix in ("weight", "weight_scale_inv")}
        loaded, as_loaded = stream, layer
        if layer.parts:
            parts, as_loaded = _split_fused_on_disk(stream, layer, global_rows[layer.name])
            loaded = stream | parts
        for rank in range(tp):
            weight, scale = _load_like_vllm(loaded, as_loaded, rank, tp)
            assert weight.dtype == torch.float8_e4m3fn and tuple(weight.shape) == layer.weight_shape, layer.name
            assert scale.dtype == torch.float32 and tuple(scale.shape) == layer.scale_shape, layer.name
    fp8_tensors = {name for name, t in stream.items() if t.dtype == torch.float8_e4m3fn or "scale_inv" in name}
    assert used == fp8_tensors
    # Qwen2's q/k/v biases travel in high precision beside their FP8 weights.
    if model_cls is Qwen2ForCausalLM:
        assert stream["model.layers.0.self_attn.k_proj.bias"].dtype == torch.float32
        # ...right after their pair, so that vLLM's layerwise reload can finish qkv_proj without buffering to the end.
        names = list(stream)
        i = names.index("model.layers.0.self_attn.k_proj.weight_scale_inv")
        assert names[i + 1] == "model.layers.0.self_attn.k_proj.bias"


def test_a_lora_learner_configures_and_fills_vllm_as_the_plain_model_does():
    """vLLM is built from the checkpoint's names: a PEFT-wrapped learner must give it the same `ignored_layers`, the
    same fused layers and, its adapters starting at B = 0, the very same stream."""
    from peft import LoraConfig, get_peft_model

    from trl_fp8.quant.lora import convert_lora_layers

    plain = tiny_model(LlamaConfig, LlamaForCausalLM, **TP_READY)
    lora_config = LoraConfig(target_modules="all-linear", lora_dropout=0.0)
    adapted = get_peft_model(copy.deepcopy(plain), lora_config).get_base_model()
    recipe = FP8Recipe(num_first_layers_in_bf16=1)
    assert fp8_llm_kwargs(adapted, recipe) == fp8_llm_kwargs(plain, recipe)
    assert vllm_linears(adapted, 2) == vllm_linears(plain, 2)
    convert_to_fp8(plain, recipe)
    convert_to_fp8(adapted, recipe)
    assert len(convert_lora_layers(adapted)) == 2 * 7  # layers 1 and 2: the first stays in BF16
    ours, theirs = list(iter_fp8_state(adapted)), dict(iter_fp8_state(plain))
    assert sorted(n for n, _ in ours) == sorted(theirs)  # each name once (layer 0's merged BF16 weights come in order)
    for name, a in ours:
        b = theirs[name]
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


def test_tp_block_shape_error_names_the_layer():
    model = tiny_model(LlamaConfig, LlamaForCausalLM)  # head_dim 64, 2 KV heads: k/v have 64 rows per rank at TP 2
    assert check_vllm_fp8_layers(model, FP8Recipe(), 1) == []
    with pytest.raises(
        ValueError, match=r"model.layers.0.self_attn.qkv_proj.*tensor_parallel_size=2.*k_proj per rank is 64"
    ):
        check_vllm_fp8_layers(model, FP8Recipe(), 2)
    with pytest.raises(ValueError, match=r"fuses model.layers.0.self_attn.qkv_proj.*k_proj \(high precision\)"):
        check_vllm_fp8_layers(model, FP8Recipe(modules_to_not_convert=["k_proj"]), 1)


def test_kv_heads_replicated_over_ranks_keep_their_rows():
    """With fewer KV heads than ranks vLLM replicates them: each rank still holds a whole head of k and v."""
    model = tiny_model(LlamaConfig, LlamaForCausalLM, **TP_READY)  # 2 KV heads of 128 rows, 4 ranks
    assert check_vllm_fp8_layers(model, FP8Recipe(), 4) == []
    qkv = next(layer for layer in vllm_linears(model, 4) if layer.name.endswith("qkv_proj"))
    assert qkv.output_partition_sizes == (128, 128, 128)


def test_tp_block_shape_error_names_the_part_of_a_module_fused_on_disk():
    model = tiny_model(Phi3Config, Phi3ForCausalLM)  # as above: k and v have 64 rows per rank at TP 2
    assert check_vllm_fp8_layers(model, FP8Recipe(), 1) == []
    with pytest.raises(
        ValueError, match=r"model.layers.0.self_attn.qkv_proj.*=2: output of the k part of .*qkv_proj per rank is 64"
    ):
        check_vllm_fp8_layers(model, FP8Recipe(), 2)
    # Kept in high precision, it is named by its parts too: vLLM's `is_layer_skipped` expands a fused layer's name
    # into q_proj/k_proj/v_proj (gate_proj/up_proj) and looks those up in ignored_layers.
    ignored = check_vllm_fp8_layers(model, FP8Recipe(modules_to_not_convert=["layers.1.self_attn.qkv_proj"]), 1)
    assert ignored == [f"model.layers.1.self_attn.{p}" for p in ("qkv_proj", "q_proj", "k_proj", "v_proj")]
    narrow_mlp = tiny_model(
        Phi3Config, Phi3ForCausalLM, **TP_READY | dict(intermediate_size=384)
    )  # gate: 192 per rank
    with pytest.raises(
        ValueError, match=r"output of the gate part of model.layers.0.mlp.gate_up_proj per rank is 192"
    ):
        check_vllm_fp8_layers(narrow_mlp, FP8Recipe(), 2)


def test_moe_routers_and_high_precision_experts_are_ignored_by_vllm_and_streamed_per_expert():
    """vLLM builds MoE routers with the model's quant config (Qwen3-MoE) and loads experts per expert: routers of any
    class, and fused experts the recipe keeps in high precision, must be in `ignored_layers`, and those experts must
    travel under vLLM's per-expert names."""
    model = tiny_qwen3_moe()
    recipe = FP8Recipe(num_first_layers_in_bf16=1)
    ignored = fp8_llm_kwargs(model, recipe)["hf_overrides"]["quantization_config"]["ignored_layers"]
    assert {"model.layers.0.mlp.gate", "model.layers.1.mlp.gate", "model.layers.0.mlp.experts"} <= set(ignored)
    assert "model.layers.1.mlp.experts" not in ignored
    convert_to_fp8(model, recipe)
    stream = dict(stream_checkpoint_names(model, recipe, [])(list(iter_fp8_state(model))))
    assert not any(name.endswith((".experts.gate_up_proj", ".experts.down_proj")) for name in stream)
    experts = model.model.layers[0].mlp.experts
    e, two_i, h = experts.gate_up_proj.shape
    for i in range(e):
        prefix = f"model.layers.0.mlp.experts.{i}."
        assert torch.equal(stream[prefix + "gate_proj.weight"], experts.gate_up_proj[i, : two_i // 2])
        assert torch.equal(stream[prefix + "up_proj.weight"], experts.gate_up_proj[i, two_i // 2 :])
        assert torch.equal(stream[prefix + "down_proj.weight"], experts.down_proj[i])
        fp8 = f"model.layers.1.mlp.experts.{i}.down_proj."
        assert stream[fp8 + "weight"].dtype == torch.float8_e4m3fn and fp8 + "weight_scale_inv" in stream
    with pytest.raises(
        ValueError, match=r"model.layers.\d.mlp.experts .*size=2: the expert intermediate size per rank is 64"
    ):
        check_vllm_fp8_layers(tiny_qwen3_moe(), FP8Recipe(), 2)


def test_row_parallel_inputs_split_in_whole_blocks():
    """vLLM splits down_proj's (and o_proj's) input across ranks: each rank's share must be whole 128-column blocks,
    here 384 / 2 = 192 (gate/up kept in high precision, so the fused column-parallel layer is not what fails)."""
    model = tiny_model(LlamaConfig, LlamaForCausalLM, **{**TP_READY, "intermediate_size": 384})
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj.*input per rank 192 is not a multiple of 128"):
        check_vllm_fp8_layers(model, FP8Recipe(modules_to_not_convert=["gate_proj", "up_proj"]), 2)
    check_vllm_fp8_layers(model, FP8Recipe(modules_to_not_convert=["gate_proj", "up_proj"]), 1)
    # Phi's attention output is `dense` and its MLP's `fc2`, row-parallel too (the column-parallel layers kept in
    # high precision): 256 / 4 = 64 and 512 / 8 = 64 columns per rank.
    phi, kept = tiny("phi"), ["q_proj", "k_proj", "v_proj", "fc1"]
    with pytest.raises(
        ValueError, match=r"model.layers.0.self_attn.dense.*input per rank 64 is not a multiple of 128"
    ):
        check_vllm_fp8_layers(phi, FP8Recipe(modules_to_not_convert=kept), 4)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.fc2.*input per rank 64 is not"):
        check_vllm_fp8_layers(phi, FP8Recipe(modules_to_not_convert=[*kept, "dense"]), 8)


def test_mla_fused_a_projections_need_one_precision():
    """DeepSeek-V3's q_a_proj (128 rows) and kv_a_proj_with_mqa (192: not whole blocks) are one fused layer in vLLM."""
    with pytest.raises(
        ValueError, match=r"fuses model.layers.0.self_attn.fused_qkv_a_proj.*kv_a_proj_with_mqa \(high"
    ):
        check_vllm_fp8_layers(tiny_deepseek_v3(), FP8Recipe())
    ignored = check_vllm_fp8_layers(tiny_deepseek_v3(), MOONLIGHT_RECIPE)
    assert "model.layers.1.self_attn.kv_a_proj_with_mqa" in ignored and "model.layers.1.mlp.gate" in ignored
    # vLLM replicates the fused a-projection on every rank (ReplicatedLinear): whole rows under any TP size.
    model = tiny_deepseek_v3()
    whole = {layer.name: layer for layer in vllm_linears(model, 1)}
    for layer in vllm_linears(model, 2):
        if layer.name.endswith("fused_qkv_a_proj"):
            assert layer.tp_size == 1 and layer.output_partition_sizes == whole[layer.name].output_partition_sizes
