"""The weight refit into vLLM, decided without vLLM: the call sequence around a sync (sleep mode included), what a
failed reload leaves, the names a stream tensor or an unloaded engine parameter gets in errors, and the attention
backends whose K/V scales would go stale. vLLM's own reload runs in tests/test_vllm_end_to_end.py."""

import sys

import pytest
import torch
from conftest import tiny_model
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from trl_fp8 import FP8Recipe, convert_to_fp8, iter_fp8_state
from trl_fp8.generation.vllm_fp8 import (
    FP8VLLMGeneration,
    attention_impls,
    check_kv_scale_backend,
)
from trl_fp8.generation.vllm_refit import check_reload_complete, refit, reload_in_config, unloaded_parameters


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


def _sync_engine(llm, stream, sleeping: bool = False) -> FP8VLLMGeneration:
    """An `FP8VLLMGeneration` holding only what `sync_weights` reads, over the stand-in `llm` and a `stream()` of
    (name, tensor) pairs; with `sleeping`, in sleep mode with its weights asleep."""
    engine = object.__new__(FP8VLLMGeneration)
    engine.llm, engine.enable_sleep_mode, engine._llm_weights_sleeping = llm, sleeping, sleeping
    engine.kv_cache, engine._stream_meta = False, None
    engine.state_stream = lambda kv_scale_invs=None: stream()
    return engine


def test_sync_weights_wakes_sleeping_weights_once_even_when_the_reload_fails():
    """With sleep mode, `sync_weights` wakes the weights only while they sleep (a second sync without a generation
    between them finds them awake), and records them awake as soon as they are: after a refit that failed inside the
    reload, the next sync must not wake them again. A stand-in: vLLM's CPU build has no sleep mode, and the engine here
    is `_RecordingLLM`."""
    engine = _sync_engine(_RecordingLLM(fail_reloads=1), lambda: [("model.norm.weight", torch.ones(4))], sleeping=True)
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


def test_a_bad_stream_never_reaches_vllm():
    """`sync_weights` validates the whole stream before any of it reaches vLLM (DESIGN.md §3: a failed sync leaves the
    engine on its last good weights; vLLM's layerwise reload would otherwise write the layers before the bad tensor
    and then fail half-way). `validate_stream` itself is tested in tests/test_vllm_engine.py; this checks that the
    engine calls it, and before the refit, on a real converted model's stream."""
    model = tiny_model(LlamaConfig, LlamaForCausalLM)
    convert_to_fp8(model, FP8Recipe())
    good = list(iter_fp8_state(model))
    current = {"pairs": good}
    engine = _sync_engine(_RecordingLLM(), lambda: current["pairs"])
    engine.sync_weights()
    assert [c[0] for c in engine.llm.calls] == ["collective_rpc", "reset_prefix_cache", "reset_enc"]
    engine.llm.calls.clear()
    # A diverged learner: a NaN in a high-precision tensor.
    current["pairs"] = [(n, t.clone().fill_(float("nan")) if n == "model.norm.weight" else t) for n, t in good]
    with pytest.raises(ValueError, match=r"NaN, inf or non-positive scales in \['model.norm.weight'\]"):
        engine.sync_weights()
    assert engine.llm.calls == [], "the refit ran before (or without) the stream's validation"
    # A stream whose layout changed since the first sync (vLLM loads into the first sync's storage).
    current["pairs"] = [(n, t) for n, t in good if n != "model.norm.weight"]
    with pytest.raises(ValueError, match=r"changed since the first sync: missing \['model.norm.weight'\]"):
        engine.sync_weights()
    assert engine.llm.calls == []
    current["pairs"] = good
    engine.sync_weights()
    assert [c[0] for c in engine.llm.calls] == ["collective_rpc", "reset_prefix_cache", "reset_enc"]


def test_a_prefix_cache_vllm_could_not_reset_fails_the_refit():
    """vLLM refuses to reset its prefix cache while requests run, with only a warning (it returns False): the cached
    prefixes would then serve the old weights' KV to the next generation, so the refit raises."""

    class BusyLLM(_RecordingLLM):
        def reset_prefix_cache(self):
            super().reset_prefix_cache()
            return False

    llm = BusyLLM()
    with pytest.raises(RuntimeError, match="could not reset its prefix cache"):
        refit(llm, [("model.norm.weight", torch.ones(4))])
    assert [c[0] for c in llm.calls] == ["collective_rpc", "reset_prefix_cache"]
