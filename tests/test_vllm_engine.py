"""The colocated vLLM FP8 engine: everything decidable without vLLM runs here on CPU (the `LLM` arguments, the
refused keys, the version range, vLLM's block-FP8 layout against the export stream, the TP rule, stream validation,
the refit call sequence); the end-to-end run needs vLLM and a GPU (`-m vllm`)."""

import copy
import dataclasses
import importlib.util
import json
import math
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from conftest import tiny_config_kwargs, tiny_grpo_args, tiny_policy
from transformers import LlamaConfig, LlamaForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM

from trl_fp8 import FP8Recipe, convert_to_fp8, iter_fp8_state
from trl_fp8.demo.task import digit_count_reward
from trl_fp8.demo.tiny_moe import MOONLIGHT_RECIPE, tiny_deepseek_v3, tiny_qwen3_moe
from trl_fp8.generation.vllm_fp8 import (
    VLLM_SPECIFIER,
    check_vllm_version,
    deep_gemm_e8m0_env,
    fp8_llm_kwargs,
    refit,
    reload_in_config,
    validate_stream,
)
from trl_fp8.generation.vllm_layout import check_vllm_fp8_layers, vllm_linears
from trl_fp8.quant.export import split_fused_experts
from trl_fp8.trainers import FP8GRPOConfig


ROOT = Path(__file__).resolve().parents[1]
# head_dim 128 and 2 KV heads: every q/k/v shard stays a multiple of 128 rows at TP 1 and 2.
TP_READY = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=2, head_dim=128)


def _vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def _config(**kwargs) -> FP8GRPOConfig:
    return FP8GRPOConfig("out", report_to="none", use_cpu=True, bf16=False, **kwargs)


def _model(cls_config, cls_model, **overrides):
    torch.manual_seed(0)
    if cls_config is Phi3Config:  # its default special tokens (32000) lie outside the tiny vocabulary
        overrides = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0) | overrides
    return cls_model(cls_config(**tiny_config_kwargs(**overrides))).eval()


def test_llm_kwargs_for_a_recipe():
    model = _model(LlamaConfig, LlamaForCausalLM)
    recipe = FP8Recipe(num_first_layers_in_bf16=1)
    kwargs = fp8_llm_kwargs(
        model,
        recipe,
        kv_cache=True,
        user_kwargs={"enforce_eager": True, "hf_overrides": {"max_position_embeddings": 256}},
    )
    linears = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")  # fmt: skip
    layer0 = [f"model.layers.0.{m}" for m in linears]
    assert kwargs == {
        "enforce_eager": True,
        "quantization": "fp8",
        "load_format": "dummy",
        "kv_cache_dtype": "fp8",
        "hf_overrides": {
            "max_position_embeddings": 256,
            "quantization_config": {
                "quant_method": "fp8",
                "activation_scheme": "dynamic",
                "fmt": "e4m3",
                "weight_block_size": [128, 128],
                "ignored_layers": layer0,
            },
        },
    }
    assert "kv_cache_dtype" not in fp8_llm_kwargs(model, recipe)


@pytest.mark.parametrize(
    ("key", "hint"),
    [("seed", "FP8GRPOConfig.seed"), ("tensor_parallel_size", "vllm_tensor_parallel_size"),
     ("quantization", "fp8_recipe"), ("kv_cache_dtype", "fp8_kv_cache"), ("load_format", "first sync")],
)  # fmt: skip
def test_reserved_llm_kwargs_are_refused_at_config_time(key, hint):
    with pytest.raises(ValueError, match=rf"vllm_llm_kwargs\['{key}'\].*{hint}"):
        _config(use_vllm=True, vllm_llm_kwargs={key: 1})
    with pytest.raises(ValueError, match=r"\['hf_overrides'\] must be a dict"):
        _config(use_vllm=True, vllm_llm_kwargs={"hf_overrides": lambda config: config})
    with pytest.raises(ValueError, match=r"\['quantization_config'\] is set by FP8GRPOTrainer"):
        _config(use_vllm=True, vllm_llm_kwargs={"hf_overrides": {"quantization_config": {}}})
    with pytest.raises(ValueError, match=r"vllm_llm_kwargs is not valid JSON .*'\{enforce_eager: true\}'"):
        _config(use_vllm=True, vllm_llm_kwargs="{enforce_eager: true}")
    with pytest.raises(ValueError, match=r"fp8_recipe is not valid JSON"):
        _config(fp8_recipe="{pow2_scales: true}")
    config = _config(use_vllm=True, vllm_llm_kwargs='{"enforce_eager": true}')
    assert config.vllm_llm_kwargs == {"enforce_eager": True}


def test_config_refuses_server_mode_and_stray_vllm_kwargs():
    with pytest.raises(ValueError, match=r"vllm_mode='server' is not supported.*vllm_mode='colocate'"):
        _config(use_vllm=True, vllm_mode="server")
    with pytest.raises(ValueError, match="use_vllm=False"):
        _config(vllm_llm_kwargs={"enforce_eager": True})
    with pytest.raises(ValueError, match=r"fp8_generation=False: TRL's own BF16 vLLM engine samples"):
        _config(use_vllm=True, fp8_generation=False, vllm_llm_kwargs={"enforce_eager": True})
    assert _config(use_vllm=True).vllm_mode == "colocate"


@pytest.mark.parametrize(
    ("version", "ok"),
    [("0.21.9", False), ("0.22.0", True), ("0.27.1", True), ("0.31.0", True), ("0.31.0rc2", True),
     ("0.31.1", False), ("0.32.0.dev3+gabc", False)],
)  # fmt: skip
def test_vllm_version_range(version, ok):
    if ok:
        assert check_vllm_version(version) == version
    else:
        with pytest.raises(ImportError, match=r"outside the range trl-fp8 supports \(>=0.22.0,<=0.31.0\)"):
            check_vllm_version(version)


def test_version_range_is_the_vllm_extra():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["vllm"] == [f"vllm{VLLM_SPECIFIER}"]


def test_deep_gemm_e8m0_follows_pow2_scales(monkeypatch):
    monkeypatch.delenv("VLLM_USE_DEEP_GEMM_E8M0", raising=False)
    assert deep_gemm_e8m0_env(FP8Recipe()) == "0"
    assert deep_gemm_e8m0_env(FP8Recipe(pow2_scales=True)) == "1"
    monkeypatch.setenv("VLLM_USE_DEEP_GEMM_E8M0", "1")
    with pytest.raises(ValueError, match="re-round the trainer scales"):
        deep_gemm_e8m0_env(FP8Recipe())
    monkeypatch.setenv("VLLM_USE_DEEP_GEMM_E8M0", "0")
    with pytest.raises(ValueError, match="serve pow2 scales as fp32"):
        deep_gemm_e8m0_env(FP8Recipe(pow2_scales=True))


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
    model = _model(config_cls, model_cls, **TP_READY)
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

    plain = _model(LlamaConfig, LlamaForCausalLM, **TP_READY)
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
    model = _model(LlamaConfig, LlamaForCausalLM)  # head_dim 64, 2 KV heads: k/v have 64 rows per rank at TP 2
    assert check_vllm_fp8_layers(model, FP8Recipe(), 1) == []
    with pytest.raises(
        ValueError, match=r"model.layers.0.self_attn.qkv_proj.*tensor_parallel_size=2.*k_proj per rank is 64"
    ):
        check_vllm_fp8_layers(model, FP8Recipe(), 2)
    with pytest.raises(ValueError, match=r"fuses model.layers.0.self_attn.qkv_proj.*k_proj \(high precision\)"):
        check_vllm_fp8_layers(model, FP8Recipe(modules_to_not_convert=["k_proj"]), 1)


def test_kv_heads_replicated_over_ranks_keep_their_rows():
    """With fewer KV heads than ranks vLLM replicates them: each rank still holds a whole head of k and v."""
    model = _model(LlamaConfig, LlamaForCausalLM, **TP_READY)  # 2 KV heads of 128 rows, 4 ranks
    assert check_vllm_fp8_layers(model, FP8Recipe(), 4) == []
    qkv = next(layer for layer in vllm_linears(model, 4) if layer.name.endswith("qkv_proj"))
    assert qkv.output_partition_sizes == (128, 128, 128)


def test_tp_block_shape_error_names_the_part_of_a_module_fused_on_disk():
    model = _model(Phi3Config, Phi3ForCausalLM)  # as above: k and v have 64 rows per rank at TP 2
    assert check_vllm_fp8_layers(model, FP8Recipe(), 1) == []
    with pytest.raises(
        ValueError, match=r"model.layers.0.self_attn.qkv_proj.*=2: output of the k part of .*qkv_proj per rank is 64"
    ):
        check_vllm_fp8_layers(model, FP8Recipe(), 2)
    # Kept in high precision, it is named by its parts too: vLLM's `is_layer_skipped` expands a fused layer's name
    # into q_proj/k_proj/v_proj (gate_proj/up_proj) and looks those up in ignored_layers.
    ignored = check_vllm_fp8_layers(model, FP8Recipe(modules_to_not_convert=["layers.1.self_attn.qkv_proj"]), 1)
    assert ignored == [f"model.layers.1.self_attn.{p}" for p in ("qkv_proj", "q_proj", "k_proj", "v_proj")]
    narrow_mlp = _model(Phi3Config, Phi3ForCausalLM, **TP_READY | dict(intermediate_size=384))  # gate: 192 per rank
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
    stream = dict(split_fused_experts(list(iter_fp8_state(model))))
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
    model = _model(LlamaConfig, LlamaForCausalLM, **{**TP_READY, "intermediate_size": 384})
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj.*input per rank 192 is not a multiple of 128"):
        check_vllm_fp8_layers(model, FP8Recipe(modules_to_not_convert=["gate_proj", "up_proj"]), 2)
    check_vllm_fp8_layers(model, FP8Recipe(modules_to_not_convert=["gate_proj", "up_proj"]), 1)


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


def test_validate_stream_refuses_bad_streams_before_sending():
    model = _model(LlamaConfig, LlamaForCausalLM)
    convert_to_fp8(model, FP8Recipe())
    pairs = list(iter_fp8_state(model))
    meta = validate_stream(pairs, None)
    assert validate_stream(pairs, meta) == meta
    bad = [(n, t.clone().fill_(float("nan")) if n == "model.norm.weight" else t) for n, t in pairs]
    with pytest.raises(ValueError, match=r"NaN, inf or non-positive scales in \['model.norm.weight'\]"):
        validate_stream(bad, meta)
    name = "model.layers.1.mlp.up_proj.weight_scale_inv"
    with pytest.raises(ValueError, match=rf"{name} is torch.float32 \(4, 1\).*512x256 needs fp32 128x128 blocks"):
        validate_stream([(n, t[:, :1] if n == name else t) for n, t in pairs], None)
    with pytest.raises(ValueError, match=r"changed since the first sync: missing \['model.norm.weight'\]"):
        validate_stream([(n, t) for n, t in pairs if n != "model.norm.weight"], meta)
    for bad_scale in (0.0, -1.0):  # a zero or negative weight scale would zero or flip the layer in vLLM
        bad = [(n, t.clone().fill_(bad_scale) if n == name else t) for n, t in pairs]
        with pytest.raises(ValueError, match=rf"non-positive scales in \['{name}'\]"):
            validate_stream(bad, meta)
    with pytest.raises(ValueError, match="names a tensor twice"):
        validate_stream([*pairs, pairs[-1]], None)
    # From the second sync on, a tensor's dtype (or shape) may not change: vLLM loads into the first sync's storage.
    with pytest.raises(ValueError, match=r"changed since the first sync: .*changed \[\('model.norm.weight'"):
        validate_stream([(n, t.bfloat16() if n == "model.norm.weight" else t) for n, t in pairs], meta)
    with pytest.raises(ValueError, match=rf"{name} is torch.bfloat16 \(4, 2\)"):
        validate_stream([(n, t.bfloat16() if n == name else t) for n, t in pairs], None)
    weight = name.removesuffix("_scale_inv")
    with pytest.raises(ValueError, match=rf"{name} has no float8_e4m3fn {weight} beside it"):
        validate_stream([(n, t.float() if n == weight else t) for n, t in pairs], None)
    # vLLM would take a non-positive KV scale for 1.0 without a word.
    kv = [*pairs, ("model.layers.0.self_attn.k_scale", torch.tensor(-1.0))]
    with pytest.raises(ValueError, match=r"non-positive scales in \['model.layers.0.self_attn.k_scale'\]"):
        validate_stream(kv, None)


def test_fp8_kv_cache_is_refused_for_latent_attention():
    """vLLM caches MLA's compressed latent, not the K/V the calibration measures, and loads no `self_attn.k_scale`
    there: DeepSeek-V3-style models are refused before an engine is built."""
    with pytest.raises(ValueError, match=r"fp8_kv_cache=True is not supported for deepseek_v3.*kv_lora_rank"):
        fp8_llm_kwargs(tiny_deepseek_v3(), MOONLIGHT_RECIPE, kv_cache=True)
    assert "kv_cache_dtype" not in fp8_llm_kwargs(tiny_deepseek_v3(), MOONLIGHT_RECIPE)


def test_latent_attention_runs_eagerly_on_vllm_before_0_31():
    """Before 0.31 vLLM re-derives MLA's W_UV / W_UK_T as new tensors at each reload, which captured CUDA graphs
    would not see."""
    model, recipe = tiny_deepseek_v3(), MOONLIGHT_RECIPE
    assert fp8_llm_kwargs(model, recipe, vllm_version="0.22.0")["enforce_eager"] is True
    assert "enforce_eager" not in fp8_llm_kwargs(model, recipe, vllm_version="0.31.0")
    assert "enforce_eager" not in fp8_llm_kwargs(
        _model(LlamaConfig, LlamaForCausalLM), FP8Recipe(), vllm_version="0.22.0"
    )
    with pytest.raises(ValueError, match=r"vLLM 0.27.1 with multi-head latent attention needs enforce_eager=True"):
        fp8_llm_kwargs(model, recipe, vllm_version="0.27.1", user_kwargs={"enforce_eager": False})


@pytest.mark.skipif(_vllm_installed(), reason="with vLLM installed this would build a real engine")
def test_trl_builds_the_fp8_engine_in_its_vllm_slot(tmp_path, demo_tokenizer):
    """The real GRPOTrainer, given use_vllm=True, constructs FP8VLLMGeneration with its own arguments: without vLLM
    here, the first thing that engine does is refuse, naming the extra to install (TRL's engine would say
    otherwise)."""
    from trl_fp8 import FP8GRPOTrainer
    from trl_fp8.demo.task import make_dataset

    with pytest.raises(ImportError, match=r'use_vllm=True needs vLLM: pip install "trl-fp8\[vllm\]"'):
        FP8GRPOTrainer(
            model=tiny_policy(demo_tokenizer),
            reward_funcs=digit_count_reward,
            args=tiny_grpo_args(tmp_path, use_vllm=True),
            train_dataset=make_dataset(8),
            processing_class=demo_tokenizer,
        )
    import trl.trainer.grpo_trainer as trl_grpo
    from trl.generation.vllm_generation import VLLMGeneration

    assert trl_grpo.VLLMGeneration is VLLMGeneration  # TRL's slot is restored even when construction fails


class _RecordingLLM:
    """Stands in for `vllm.LLM`, which cannot run on CPU: records the calls a refit makes, in order."""

    def __init__(self):
        self.calls = []

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        kwargs = dict(kwargs)
        kwargs["weights_iterator"] = [name for name, _ in kwargs["weights_iterator"]]
        self.calls.append(("collective_rpc", method, kwargs))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


@pytest.mark.parametrize("sleep_mode", [False, True])
def test_refit_call_sequence(sleep_mode):
    pairs = [("a.weight", torch.zeros(2)), ("b.weight", torch.ones(2))]
    llm = _RecordingLLM()
    refit(llm, pairs, wake_weights=sleep_mode)
    reload = ("collective_rpc", reload_in_config, {"weights_iterator": ["a.weight", "b.weight"]})
    assert llm.calls == [("wake_up", ["weights"])] * sleep_mode + [reload, ("reset_prefix_cache",)]


def _vllm_ready() -> bool:
    return _vllm_installed() and torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.skipif(not _vllm_ready(), reason="needs vLLM and a CUDA GPU")
@pytest.mark.parametrize(("kv_cache", "lora"), [(False, False), (True, False), (False, True)], ids=["", "kv", "lora"])
def test_colocated_vllm_fp8_grpo_end_to_end(tmp_path, kv_cache, lora):
    """Two GRPO steps with colocated vLLM in block FP8 (in a fresh process: one vLLM engine per process). The engine
    then holds the learner's export bit for bit (with LoRA: each layer's merged weight), the mismatch stays small
    (< 1.05; < 1.1 with the FP8 KV cache, whose synced K/V/Q scales vLLM must hold), and 50 more syncs leave GPU
    memory flat."""
    cmd = [sys.executable, str(ROOT / "tests" / "scripts" / "vllm_two_steps.py"), str(tmp_path)]
    cmd += ["--kv_cache"] * kv_cache + ["--lora"] * lora
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-4000:]
    out = json.loads((tmp_path / "result.json").read_text())
    assert out["errors"] and max(out["errors"]) < (1.1 if kv_cache else 1.05), out["errors"]
    assert out["bit_identical"] == {"weight": True, "weight_scale_inv": True}
    if kv_cache:
        torch.testing.assert_close(torch.tensor(out["kv_scales_served"]), torch.tensor(out["kv_scales_sent"]))
    assert out["memory_growth_bytes"] < 16 * 2**20
