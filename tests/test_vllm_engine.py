"""The colocated vLLM FP8 engine: everything decidable without vLLM runs here on CPU (the `LLM` arguments, the
refused keys, the version range, stream validation, the refit call sequence; vLLM's block-FP8 layout and the TP rule
are in tests/test_vllm_layout.py); the end-to-end runs need vLLM: its CUDA build on a GPU, or its CPU build
(`-m vllm`, tests/scripts/vllm_cpu.sh)."""

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from conftest import (
    NO_VLLM_FP8_KV_CACHE,
    families,
    tiny_grpo_args,
    tiny_model,
    vllm_fp8_kv_cache_ready,
    vllm_installed,
    vllm_ready,
)
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from trl_fp8 import FP8Recipe, convert_to_fp8, iter_fp8_state
from trl_fp8.demo.families import available, tiny
from trl_fp8.demo.task import digit_count_reward
from trl_fp8.demo.tiny_moe import MOONLIGHT_RECIPE, tiny_deepseek_v3
from trl_fp8.generation.vllm_fp8 import (
    VLLM_SPECIFIER,
    attention_impls,
    check_architecture,
    check_kv_scale_backend,
    check_reloadable,
    check_vllm_version,
    deep_gemm_e8m0_env,
    fp8_llm_kwargs,
    validate_stream,
    vllm_architectures,
)
from trl_fp8.generation.vllm_refit import check_reload_complete, refit, reload_in_config, unloaded_parameters
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


class _RecordingLLM:
    """Stands in for `vllm.LLM`, which cannot run on CPU: records the calls a refit makes, in order. `fail_reloads`
    reloads raise, as one that fails inside vLLM's reload does."""

    def __init__(self, fail_reloads: int = 0):
        self.calls, self.fail_reloads = [], fail_reloads
        self.llm_engine = type("LLMEngine", (), {"reset_encoder_cache": lambda _: self.calls.append(("reset_enc",))})()

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        kwargs = dict(kwargs)
        kwargs["weights_iterator"] = [name for name, _ in kwargs["weights_iterator"]]
        self.calls.append(("collective_rpc", method, kwargs))
        if self.fail_reloads:
            self.fail_reloads -= 1
            raise RuntimeError("simulated out-of-memory while vLLM rebuilds a layer")
        return [[]]  # one worker, nothing left unloaded

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


@pytest.mark.parametrize("sleep_mode", [False, True], ids=["awake", "sleep_mode"])
def test_refit_call_sequence(sleep_mode):
    """After the reload, the caches of what the old weights computed go: the prefix (KV) cache, and the encoder
    cache on both sides (scheduler and workers; the vLLM test plants an entry in each), which vLLM 0.31's reload
    clears on the workers only. An engine without `reset_encoder_cache` is passed over. Waking is the caller's."""
    pairs = [("a.weight", torch.zeros(2)), ("b.weight", torch.ones(2))]
    llm = _RecordingLLM()
    refit(llm, pairs, sleep_mode=sleep_mode)
    reload = ("collective_rpc", reload_in_config, {"weights_iterator": ["a.weight", "b.weight"]})
    assert llm.calls == [reload, ("reset_prefix_cache",), ("reset_enc",)]
    llm.llm_engine = object()
    refit(llm, pairs, sleep_mode=sleep_mode)
    assert llm.calls[3:] == [reload, ("reset_prefix_cache",)]


def test_sync_weights_wakes_sleeping_weights_once_even_when_the_reload_fails():
    """With sleep mode, `sync_weights` wakes the weights only while they sleep (a second sync without a generation
    between them finds them awake), and records them awake as soon as they are: after a refit that failed inside the reload, the next sync must not
    wake them again. A stand-in: vLLM's CPU build has no sleep mode, and the engine here is `_RecordingLLM`."""
    from trl_fp8.generation.vllm_fp8 import FP8VLLMGeneration

    engine = object.__new__(FP8VLLMGeneration)  # only what sync_weights reads
    engine.llm, engine.enable_sleep_mode, engine._llm_weights_sleeping = _RecordingLLM(fail_reloads=1), True, True
    engine.kv_cache, engine._stream_meta = False, None
    engine.state_stream = lambda kv_scale_invs=None: [("model.norm.weight", torch.ones(4))]
    with pytest.raises(RuntimeError, match="simulated out-of-memory"):
        engine.sync_weights()
    assert not engine._llm_weights_sleeping
    engine.sync_weights()
    assert [call[0] for call in engine.llm.calls] == [
        "wake_up",
        "collective_rpc",
        "collective_rpc",
        "reset_prefix_cache",
        "reset_enc",
    ]
    engine._llm_weights_sleeping = True  # a generation put them to sleep again
    engine.sync_weights()
    assert [call[0] for call in engine.llm.calls[5:7]] == ["wake_up", "collective_rpc"]


class _FakeWorker:
    """Stands in for a vLLM worker in `reload_in_config`: its model's `load_weights` looks each name up unchecked, as
    vLLM's deepseek_v2.py does (`params_dict[name]`)."""

    def __init__(self):
        self.vllm_config = None
        model = nn.Linear(2, 2)

        def load_weights(weights):
            params = dict(model.named_parameters())
            for name, tensor in weights:
                params[name].data.copy_(tensor)  # a KeyError for a name the model lacks
            return set(params)

        model.load_weights = load_weights
        self.model_runner = type("ModelRunner", (), {})()
        self.model_runner.get_model = lambda: model
        self.model_runner.reload_weights = lambda weights_iterator, is_checkpoint_format: model.load_weights(
            weights_iterator
        )


def test_a_stream_tensor_the_vllm_model_lacks_is_named_in_the_error(monkeypatch):
    """A first sync whose stream names a tensor vLLM's model class lacks: some models' `load_weights` raise a bare
    KeyError with vLLM's spelling of the name; the error then names the last tensor taken from the stream, and the
    way out."""
    import contextlib
    import types

    vllm_config = types.ModuleType("vllm.config")
    vllm_config.set_current_vllm_config = lambda config: contextlib.nullcontext()
    monkeypatch.setitem(sys.modules, "vllm.config", vllm_config)
    monkeypatch.setitem(sys.modules, "vllm.model_executor.model_loader.reload", None)  # no layerwise restore here
    worker = _FakeWorker()
    pairs = [("weight", torch.ones(2, 2)), ("bias", torch.zeros(2))]
    assert reload_in_config(worker, iter(pairs)) == []
    extra = "model.layers.0.self_attn.q_norm.weight"
    with pytest.raises(KeyError) as raised:
        reload_in_config(worker, iter([*pairs, (extra, torch.ones(2))]))
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    assert f"the last tensor vLLM took from the sync stream was '{extra}'" in notes
    assert "most likely has no parameter for it" in notes and "fp8_generation=False" in notes


def test_a_refit_that_left_engine_parameters_unloaded_is_refused_naming_them():
    """The workers' reports (`reload_in_config`, run on vLLM's engine in the vLLM tests): the attention layers' K/V/Q
    scales are owed only with the FP8 KV cache, `prob_scale` never; a worker that reports nothing (None) passes."""
    attn = "model.layers.0.self_attn.attn."
    kv_scales = [attn + name for name in ("k_scale", "prob_scale", "q_scale", "v_scale")]
    check_reload_complete([kv_scales, None], kv_cache=False)
    check_reload_complete([[attn + "prob_scale"]], kv_cache=True)
    with pytest.raises(ValueError, match=r"did not load 3 of its parameters .*\['model.layers.0.self_attn.attn.k_sc"):
        check_reload_complete([kv_scales], kv_cache=True)
    gate = "model.layers.1.mlp.gate_up_proj.weight"
    with pytest.raises(
        ValueError, match=r"did not load 1 of its parameters .*gate_up_proj.weight'\]; it now holds stale"
    ):
        check_reload_complete([[gate], [gate, attn + "prob_scale"]], kv_cache=False)


def test_what_vllm_reports_loaded_covers_aliases_base_layers_and_moe_names_one_module_up():
    """`unloaded_parameters`, the comparison `reload_in_config` makes on each worker (run on vLLM's engine in the vLLM
    tests): a tied `lm_head`, laid out by the reload as a tensor of its own, is covered by the embedding it shares,
    whichever name came first; LoRA's `base_layer` names by their layer's; vLLM 0.31's experts by their MoE layer's."""
    tied = {"model.embed_tokens.weight": ("model.embed_tokens.weight", "lm_head.weight")}
    tied["lm_head.weight"] = tied["model.embed_tokens.weight"]
    expected = {"model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.experts.routed_experts.w2_weight",
                "model.layers.0.self_attn.o_proj.base_layer.weight"}  # fmt: skip
    loaded = {
        "model.embed_tokens.weight",
        "model.layers.0.mlp.experts.w2_weight",
        "model.layers.0.self_attn.o_proj.weight",
    }
    assert unloaded_parameters(expected, loaded, tied) == []
    assert unloaded_parameters(expected, loaded - {"model.embed_tokens.weight"}, tied) == [
        "lm_head.weight",
        "model.embed_tokens.weight",
    ]
    untied = {"lm_head.weight"} | loaded - {"model.embed_tokens.weight"}
    assert unloaded_parameters(expected, untied, {}) == ["model.embed_tokens.weight"]
    # Only the experts' own module is skipped over: a parameter one module up is not, in general, the same one.
    assert unloaded_parameters({"model.layers.0.mlp.gate_up_proj.weight"}, {"model.layers.0.weight"}, {}) == [
        "model.layers.0.mlp.gate_up_proj.weight"
    ]


def test_fp8_kv_cache_refuses_an_attention_backend_that_keeps_stale_scales():
    """vLLM's FlashInfer backend computes its K/V scale products once, at its first forward (and its host floats
    freeze in CUDA graphs), so every later refit's KV scales would go unseen. FlashInfer cannot run here: the
    stand-in is a module tree whose attention layers hold implementations of those class names, as vLLM's
    `Attention.impl` does; the real check runs on every engine the vLLM tests build (CPU attention passes)."""
    impls = {name: type(name, (), {}) for name in ("FlashInferImpl", "FlashAttentionImpl")}

    def model(impl: str) -> nn.Module:
        layers = nn.ModuleList(nn.Module() for _ in range(2))
        for layer in layers:
            layer.attn = nn.Module()
            layer.attn.impl = impls[impl]()
        return nn.ModuleDict({"layers": layers})

    found = attention_impls(model("FlashInferImpl"))
    assert found == {"layers.0.attn": "FlashInferImpl", "layers.1.attn": "FlashInferImpl"}
    with pytest.raises(ValueError, match=r"fp8_kv_cache: vLLM picked FlashInferImpl for \['layers.0.attn', "
                       r"'layers.1.attn'\].*\{\"attention_backend\": \"FLASH_ATTN\"\}"):  # fmt: skip
        check_kv_scale_backend(found)
    check_kv_scale_backend(attention_impls(model("FlashAttentionImpl")))
    # vLLM 0.31's TRITON_FLASHINFER (Blackwell) wraps a FlashInferImpl in a composite implementation.
    composite = model("FlashAttentionImpl")
    for layer in composite.layers:
        layer.attn.impl = type("CompositeAttentionImpl", (), {})()
        layer.attn.impl.general_impl, layer.attn.impl.causal_impl = (
            impls["FlashInferImpl"](),
            impls["FlashAttentionImpl"](),
        )
    found = attention_impls(composite)
    assert found["layers.1.attn"] == "CompositeAttentionImpl(FlashInferImpl, FlashAttentionImpl)"
    with pytest.raises(ValueError, match=r"vLLM picked CompositeAttentionImpl\(FlashInferImpl, FlashAttentionImpl\)"):
        check_kv_scale_backend(found)


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_ready(), reason="needs vLLM (its CUDA build on a GPU, or vllm-cpu)")
def test_a_refit_that_fails_inside_vllms_reload_leaves_the_engine_whole(tmp_path):
    """A refit can fail inside vLLM's reload (an out-of-memory while it rebuilds a layer, a KeyboardInterrupt), after
    it moved every layer's tensors to the meta device: only its finalize puts back the layers it did not reach. Here
    the stream raises after layer 0 and the first weight of layer 1 (in a fresh process): the error says what the
    engine holds, nothing is left on meta, layer 0 holds the new weights and layer 1 the previous ones, the engine
    still generates, and the next sync refits it whole. Without the restore, 20 parameters stayed on meta, the next
    sync failed and generation hung. That sync also clears the encoder cache of an image seen before (vision
    embeddings computed with the old weights), on the scheduler's side too: vLLM 0.31's reload clears only the
    worker's, and the next request with that image then failed with "Encoder cache miss"."""
    cmd = [sys.executable, str(ROOT / "tests" / "scripts" / "vllm_failed_refit.py"), str(tmp_path)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-4000:]
    out = json.loads((tmp_path / "result.json").read_text())
    assert out["error"].startswith("simulated out-of-memory") and "refits them all" in out["notes"][0]
    assert "model.layers.1.self_attn.q_proj.weight'" in out["notes"][1]  # the last tensor vLLM took
    assert out["meta"] == []
    assert out["layer0_new"] and out["layer1_old"] and not out["layer1_new"]
    assert out["generates"] and out["resynced"]
    assert out["encoder_cache_after_refit"] == {"scheduler": False, "worker": False}


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_ready(), reason="needs vLLM (its CUDA build on a GPU, or vllm-cpu)")
@pytest.mark.parametrize(
    ("kv_cache", "lora"),
    [
        pytest.param(False, False, id=""),
        pytest.param(
            True, False, id="kv", marks=pytest.mark.skipif(not vllm_fp8_kv_cache_ready(), reason=NO_VLLM_FP8_KV_CACHE)
        ),
        pytest.param(False, True, id="lora"),
    ],
)
def test_colocated_vllm_fp8_grpo_end_to_end(tmp_path, kv_cache, lora):
    """Two GRPO steps with colocated vLLM in block FP8 (in a fresh process: one vLLM engine per process). The engine
    then holds the learner's export bit for bit (with LoRA: each layer's merged weight) and the synced K/V/Q scales
    (the tensors and the host floats some attention backends read); 50 more syncs write into the tensors vLLM holds
    and, on a GPU, leave its memory flat; the FP8 checkpoint `save_model()` writes, served by a fresh engine, decodes
    as the refitted one. The mismatch bounds catch a sampler that does not run the synced weights
    (with the refit left out, vLLM samples from its dummy weights: 3879 and 3714 here): < 1.05, and < 1.3 with the FP8 KV cache, which on this small model
    moves single steps a lot: the reference engine, same model, batch and bf16, gave 1.01-1.23 per step over 18
    steps (3 seeds x 6), vLLM's CPU build 1.06 and 1.14."""
    cmd = [sys.executable, str(ROOT / "tests" / "scripts" / "vllm_two_steps.py"), str(tmp_path)]
    cmd += ["--kv_cache"] * kv_cache + ["--lora"] * lora
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-4000:]
    out = json.loads((tmp_path / "result.json").read_text())
    assert out["errors"] and max(out["errors"]) < (1.3 if kv_cache else 1.05), out["errors"]
    assert out["bit_identical"] == {"weight": True, "weight_scale_inv": True}
    if kv_cache:
        torch.testing.assert_close(torch.tensor(out["kv_scales_served"]), torch.tensor(out["kv_scales_sent"]))
        torch.testing.assert_close(torch.tensor(out["kv_scale_floats_served"]), torch.tensor(out["kv_scales_sent"]))
    assert out["in_place"]
    # Left out of a refit, a layer's weights are named (vLLM would keep their old values without a word).
    assert out["refit_error_full_stream"] is None
    left_out = "['model.layers.1.self_attn.o_proj.weight', 'model.layers.1.self_attn.o_proj.weight_scale_inv']"
    assert f"did not load 2 of its parameters from the FP8 sync stream: {left_out}" in out["refit_error_left_out"]
    if "memory_growth_bytes" in out:
        assert out["memory_growth_bytes"] < 16 * 2**20
    # The FP8 checkpoint saved at the end, served by a fresh engine through vLLM's own checkpoint loader, decodes as
    # the refitted engine did, token for token and log-prob for log-prob. With the FP8 KV cache it serves the
    # checkpoint's K/V/Q scales (`kv_cache_dtype="fp8"`), which vLLM's loader holds in the model's dtype, bf16 here
    # (the refit writes them in fp32): the same tokens, log-probs 0.08 apart at most on vLLM's CPU build.
    cmd = [sys.executable, str(ROOT / "tests" / "scripts" / "vllm_two_steps.py"), "--serve", str(tmp_path / "fp8")]
    result = subprocess.run([*cmd, str(tmp_path)] + ["--kv_cache"] * kv_cache, capture_output=True, text=True,
                            timeout=1200)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    served_run = json.loads((tmp_path / "served.json").read_text())
    if kv_cache:
        sent = torch.tensor(out["kv_scales_sent"])
        assert torch.equal(torch.tensor(served_run["kv_scales"]), sent.bfloat16().float())
    served = served_run["greedy"]
    assert [g["ids"] for g in served] == [g["ids"] for g in out["greedy"]]
    for ours, theirs in zip(out["greedy"], served, strict=True):
        atol = 0.25 if kv_cache else 1e-4
        torch.testing.assert_close(torch.tensor(theirs["logprobs"]), torch.tensor(ours["logprobs"]), rtol=0, atol=atol)


# The families of trl_fp8.demo.families that vLLM's CPU build serves in block FP8 (OLMo 2, SmolLM3 and Starcoder2 through
# vLLM 0.31's Transformers backend; Qwen3.5 with an empty torchvision, see tests/scripts/vllm_family.py). Left out:
# tiny Gemma 2 (untied lm_head) and Phi (GQA), which vLLM's classes cannot hold even in BF16, LFM2 (vLLM 0.31 reads
# `block_dim`, which the tiny config lacks), and GPT-OSS (refused with fp8_generation).
VLLM_FAMILIES = (
    "qwen3", "qwen3_5", "qwen3_5_moe", "qwen3_next", "mistral", "gemma3", "gemma4", "gemma3n", "olmo", "olmo2",
    "smollm3", "granite", "glm4", "starcoder2", "cohere2", "exaone4", "ernie4_5", "mixtral", "olmoe", "gpt_neox",
)  # fmt: skip


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_ready(), reason="needs vLLM (its CUDA build on a GPU, or vllm-cpu)")
@pytest.mark.parametrize(
    "family",
    [
        *families(*VLLM_FAMILIES),
        pytest.param("qwen3:tied", id="qwen3_tied_lm_head"),
        pytest.param("gemma3:multimodal", id="gemma3_multimodal"),
        pytest.param(
            "gemma4:last_layers_bf16",
            id="gemma4_last_layers_bf16",
            marks=pytest.mark.skipif(not available("gemma4"), reason="transformers has no gemma4"),
        ),
        *(
            pytest.param(
                f"{family}:fp8_kv_cache",
                id=f"{family}_fp8_kv_cache",
                marks=[
                    pytest.mark.skipif(not vllm_fp8_kv_cache_ready(), reason=NO_VLLM_FP8_KV_CACHE),
                    pytest.mark.skipif(not available(family), reason=f"transformers has no {family}"),
                ],
            )
            for family in ("qwen3_next", "gemma4", "gemma3n")
        ),
    ],
)
def test_a_family_trains_with_colocated_vllm_in_fp8(tmp_path, family):
    """Two GRPO steps of a tiny random model of `family`, with a reference model, sampled by colocated vLLM in block
    FP8: no parameter of vLLM's model is left whole at the random values of `load_format="dummy"` (for the linears
    vLLM's CPU build repacks, judged by their output on a fixed input; a shard left out of a fused parameter does not
    show here, tests/test_checkpoint_names.py holds the stream complete), later refits write in place, and the
    sampler's log-probs agree with the learner's to the bf16 rounding of two different programs (< 1.05; Gemma 4,
    the family most sensitive to FP8 rounding: < 1.15; Gemma 3n: < 1.10). With a tied
    `lm_head` (`qwen3:tied`), which the stream sends once, as the embedding, every refit's completeness check passes:
    the reload lays the two names out as separate tensors. With the FP8 KV cache (`qwen3_next:fp8_kv_cache`), vLLM
    quantizes the hybrid's attention layers' K/V with the Q/K/V scales calibrated beside its Gated DeltaNet layers'
    recurrent state, and every refit loads them (the calibration failed with an IndexError before); with Gemma 4's
    (`gemma4:fp8_kv_cache`), its KV-shared layer dequantizes what it reads, in vLLM, with the scales of the layer
    that stored it (refused before), and Gemma 3n's likewise. Gemma 3n also holds vLLM to the learner's
    high-precision layers where its text model moves them (`self_decoder`; `with_nested_renames`). Gemma 3 as
    `AutoModelForCausalLM` loads its 4B and larger checkpoints (`gemma3:multimodal`: `Gemma3ForConditionalGeneration`,
    text prompts) syncs its text decoder in FP8 under the multimodal names vLLM's class loads; its vision tower goes
    in high precision, and vLLM, given no images (`limit_mm_per_prompt`), skips it. Through vLLM's Transformers
    backend (OLMo 2, SmolLM3, Starcoder2) this also holds the learner to running after vLLM patched its decoder class
    in place; with Qwen3.5, its Gated DeltaNet projections go through vLLM's fusion (`in_proj_qkvz` in FP8,
    `in_proj_ba` in high precision). With Gemma 4's last two layers in BF16 (`gemma4:last_layers_bf16`), vLLM builds
    the engine: its K=V layer's `qkv_proj`, q_proj and k_proj (loaded twice, as K and V), is named whole in
    `ignored_layers` (it refused the layer when `v_proj`, which the learner lacks, was missing)."""
    cmd = [sys.executable, str(ROOT / "tests" / "scripts" / "vllm_family.py"), family, str(tmp_path)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-4000:]
    out = json.loads((tmp_path / "result.json").read_text())
    assert out["params"] > 0 and out["not_written"] == [], out["not_written"]
    assert out["in_place"]
    # Gemma 4's two steps measured 1.05-1.09 against vLLM 0.31 (BF16 through TRL's own engine: 1.01-1.02), the order
    # the reference engine shows for it under bf16=True (benchmarks/RESULTS.md, "Model families"), not a wrong weight
    # (every parameter is checked written above). Gemma 4 scores attention unscaled, and a random model's q/k norms
    # leave the softmax nearly one-hot: scaled by 1/sqrt(head_dim), the reference engine's 1.029 falls to 1.005
    # (`benchmarks/gemma4_mismatch.py`). Gemma 3n scores attention unscaled too: 1.037-1.043 here, where Qwen3 measured
    # 1.011-1.014 and Gemma 3 1.016-1.018 (the reference engine under bf16=True: 1.010, against 1.005 and 1.003).
    bound = {"gemma4": 1.15, "gemma3n": 1.10}.get(family.partition(":")[0], 1.05)
    assert out["errors"] and max(out["errors"]) < bound, out["errors"]
    if family.endswith(":fp8_kv_cache"):  # vLLM's kernels read the synced K/V scales, none left at its 1.0
        kv = out["kv_scales"]
        assert kv and all(0 < s < 1 for pair in kv.values() for s in pair), kv
    if family in ("gemma4:fp8_kv_cache", "gemma3n:fp8_kv_cache"):  # the last layer reads layer 1's K/V
        assert kv["model.layers.2.self_attn.attn"] == kv["model.layers.1.self_attn.attn"], kv


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
