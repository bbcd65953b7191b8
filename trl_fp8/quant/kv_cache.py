"""FP8 KV cache: per-layer Q/K/V scales calibrated from the policy, and a transformers cache that stores E4M3.

The cache stores `clamp(x / s, ±448)` in E4M3 with one static dequant multiplier `s` per layer for keys and one for
values, and dequantizes on read, as vLLM's `kv_cache_dtype="fp8"` does with checkpoint scales. vLLM names those
multipliers `k_scale` / `v_scale` (`model.layers.{i}.self_attn.k_scale`); in this package's convention they are
`scale_inv`s. Stale scales silently corrupt rollouts (values past `448 * s` saturate), so they are recalibrated from
the updated policy after every optimizer step:

    s = percentile_tokens(amax over heads and head dims of K (or V) after RoPE) * margin / 448

The percentile over tokens ignores a handful of outlier tokens; the margin leaves room for the policy to drift.
With an FP8 KV cache, vLLM's FlashAttention-3 path also quantizes the queries to E4M3 with one per-layer `q_scale`
(1.0 when none is loaded); it is calibrated the same way, and the reference engine quantizes its queries with it.
"""

import sys
from contextlib import contextmanager

import torch
import transformers
from packaging.version import Version
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, LinearAttentionCacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .blockwise import FP8_DTYPE, FP8_MAX


_TINY = torch.finfo(torch.float32).tiny
KV_SCALE_SUFFIXES = (".k_scale", ".v_scale", ".q_scale")  # vLLM's checkpoint names, under each `self_attn`
# The keyword a model's forward and `generate` take a cache by: `cache` since transformers 5.24, where
# `past_key_values` is deprecated (removed from forward in 5.40, after which it would be dropped without a word).
CACHE_KWARG = "cache" if Version(transformers.__version__).release >= (5, 24) else "past_key_values"


def attention_module_names(model: torch.nn.Module) -> list[str]:
    """The decoder layers' attention modules (`model.layers.{i}.self_attn`), whose `k_scale` / `v_scale` / `q_scale`
    vLLM reads."""
    return [name for name, m in model.named_modules() if name.endswith("self_attn") and hasattr(m, "layer_idx")]


def recurrent_layers(config) -> dict[int, LinearAttentionCacheLayerMixin]:
    """Fresh cache layers, as transformers builds them, for the decoder layers that keep a recurrent state instead of
    per-token K/V (Qwen3.5's and Qwen3-Next's Gated DeltaNet, LFM2's short convolutions), by layer index. The FP8 KV
    cache holds them as they are and quantizes the attention layers' K/V only, as vLLM does."""
    layers = DynamicCache(config=config).layers
    return {i: layer for i, layer in enumerate(layers) if isinstance(layer, LinearAttentionCacheLayerMixin)}


def kv_shared_sources(config) -> dict[int, int]:
    """For each layer that reads another layer's K/V instead of storing its own (the last `num_kv_shared_layers` of
    Gemma 4 and Gemma 3n), the layer it reads: the last earlier layer of its attention type that stores K/V, as
    transformers and vLLM pick it. Such a layer's K/V are that layer's FP8 codes, so it takes that layer's K/V
    scales."""
    shared = getattr(config, "num_kv_shared_layers", 0) or 0
    if not shared:
        return {}
    types = list(config.layer_types)
    first = len(types) - shared
    producers = {t: i for i, t in enumerate(types[:first])}  # the last of each type wins
    return {i: producers[types[i]] for i in range(first, len(types)) if types[i] in producers}


def check_kv_cache_supported(model: torch.nn.Module) -> None:
    """Refuses models whose KV cache the FP8 KV cache here does not model: MLA (DeepSeek-V2/V3, Moonlight) caches a
    compressed latent in vLLM, not the K/V this calibrates, and vLLM finds no `self_attn.k_scale` to load there;
    attention modules named otherwise (GPT-NeoX's `attention`) leave vLLM no `self_attn.k_scale` either; a layer
    that holds a recurrent state beside its K/V has no FP8 cache layer here; and layers that read K/V no layer of the
    model stores (every layer KV-shared) have no scales to take."""
    config = model.config
    what = f"fp8_kv_cache=True is not supported for {getattr(config, 'model_type', type(model).__name__)}"
    if getattr(config, "kv_lora_rank", None):
        raise ValueError(
            f"{what}: its multi-head latent attention caches a compressed latent (kv_lora_rank), whose scales trl-fp8 "
            "does not calibrate. Set fp8_kv_cache=False."
        )
    if not attention_module_names(model):
        raise ValueError(
            f"{what}: its attention modules are not named `self_attn`, where vLLM loads the K/V/Q scales "
            "(`model.layers.{i}.self_attn.k_scale`). Set fp8_kv_cache=False."
        )
    shared, sources = getattr(config, "num_kv_shared_layers", 0) or 0, kv_shared_sources(config)
    if len(sources) < shared:
        orphans = sorted(set(range(config.num_hidden_layers - shared, config.num_hidden_layers)) - set(sources))
        raise ValueError(
            f"{what}: its layers {orphans} (of the last num_kv_shared_layers={shared}) read K/V that no layer of this "
            "model stores, so there are no scales to give them. Set fp8_kv_cache=False."
        )
    both = [i for i, layer in recurrent_layers(config).items() if isinstance(layer, DynamicLayer)]
    if both:
        raise ValueError(
            f"{what}: its layers {both} keep a recurrent state and a K/V cache together, which trl-fp8's FP8 KV "
            "cache does not hold. Set fp8_kv_cache=False."
        )


def quantize_kv(x: torch.Tensor, scale_inv: float) -> torch.Tensor:
    return (x.float() / scale_inv).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_kv(q: torch.Tensor, scale_inv: float, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale_inv).to(dtype)


def kv_scale_inv_from_amax(token_amax: torch.Tensor, percentile: float = 99.9, margin: float = 1.05) -> float:
    """The dequant multiplier for one layer's K or V from its per-token amax values."""
    amax = torch.quantile(token_amax.float().flatten(), percentile / 100.0).item()
    return max(amax * margin / FP8_MAX, _TINY)


class FP8KVLayer(DynamicLayer):
    """One layer of the FP8 KV cache: E4M3 keys and values with static per-layer scales."""

    def __init__(self, k_scale_inv: float, v_scale_inv: float):
        super().__init__()
        self.k_scale_inv, self.v_scale_inv = float(k_scale_inv), float(v_scale_inv)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        empty = (*key_states.shape[:-2], 0, key_states.shape[-1])
        self.keys = torch.empty(empty, dtype=FP8_DTYPE, device=self.device)
        self.values = torch.empty(
            (*value_states.shape[:-2], 0, value_states.shape[-1]), dtype=FP8_DTYPE, device=self.device
        )
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = torch.cat([self.keys, quantize_kv(key_states, self.k_scale_inv)], dim=-2)
        self.values = torch.cat([self.values, quantize_kv(value_states, self.v_scale_inv)], dim=-2)
        # Attention reads the cache, the current tokens included: they are quantized like every cached token.
        return dequantize_kv(self.keys, self.k_scale_inv, self.dtype), dequantize_kv(
            self.values, self.v_scale_inv, self.dtype
        )


class FP8KVCache(Cache):
    """A transformers `Cache` of `FP8KVLayer`s, one per attention layer, from `scale_invs[layer_idx] = (k, v)` (a
    list: layers 0, 1, ...). With the model's `config`, the layers that keep a recurrent state instead
    (`recurrent_layers`) are transformers' own; every other layer must have scales."""

    def __init__(self, scale_invs: dict[int, tuple[float, float]] | list[tuple[float, float]], config=None):
        scale_invs = scale_invs if isinstance(scale_invs, dict) else dict(enumerate(scale_invs))
        for i, (k, v) in scale_invs.items():
            if not (k > 0 and v > 0):
                raise ValueError(f"FP8 KV cache: layer {i} has no valid k/v scale ({k}, {v}); calibrate first")
        recurrent = {} if config is None else recurrent_layers(config)
        layers = []
        for i in range(max([*scale_invs, *recurrent], default=-1) + 1):
            if i in scale_invs:
                layers.append(FP8KVLayer(*scale_invs[i]))
            elif i in recurrent:
                layers.append(recurrent[i])
            else:
                raise ValueError(f"FP8 KV cache: decoder layer {i} has neither K/V scales nor a recurrent state")
        super().__init__(layers=layers)


RECORD_QUERY_ATTENTION = "trl_fp8_record_query"
FP8_QUERY_ATTENTION = "trl_fp8_fp8_query"
_query_amax: dict[int, torch.Tensor] | None = None  # set while `calibrate_kv_scales` runs


def _called(base: str | None) -> str:
    # The implementation the model was configured with (sdpa stands in for one transformers does not register).
    return base if base and (base == "eager" or base in ALL_ATTENTION_FUNCTIONS) else "sdpa"


def _base_attention(module):
    name = _called(getattr(module, "trl_fp8_base_attention", None))
    if name != "eager":
        return ALL_ATTENTION_FUNCTIONS[name] if name in ALL_ATTENTION_FUNCTIONS else sdpa_attention_forward
    # Eager attention is each model's own function, in its modeling file: what it does beyond sdpa (Gemma 2's logit
    # softcapping, GPT-OSS's attention sinks, which sdpa would refuse or silently drop) is why a model is eager.
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise ValueError(
            f"FP8 KV cache: {type(module).__name__} is configured for eager attention, but its modeling file has no "
            "`eager_attention_forward`; load the policy with attn_implementation='sdpa'"
        )
    return eager


def _record_query(module, query, *args, **kwargs):
    if _query_amax is not None:
        _query_amax[module.layer_idx] = query.detach().abs().amax(dim=(1, 3)).float()  # (B, H, T, D) -> (B, T)
    return _base_attention(module)(module, query, *args, **kwargs)


def _fp8_query(module, query, *args, **kwargs):
    # As vLLM's `Attention.query_quant`: E4M3 with the layer's static scale, then attention on the dequantized values.
    scale_inv = module.q_scale  # vLLM's name for a dequant multiplier
    q = (query.float() / scale_inv).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * scale_inv
    return _base_attention(module)(module, q.to(query.dtype), *args, **kwargs)


_WRAPPERS = {RECORD_QUERY_ATTENTION: _record_query, FP8_QUERY_ATTENTION: _fp8_query}


def _registered(implementation: str, base: str | None) -> str:
    """The name of `implementation` in front of `base`, registered with the attention mask that `base` takes:
    transformers builds no mask at all for an implementation its mask registry does not know, and the left padding
    of batched prompts would then be attended to."""
    called = _called(base)
    name = f"{implementation}_{called}"
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, _WRAPPERS[implementation])
        mask = ALL_MASK_ATTENTION_FUNCTIONS[called] if called in ALL_MASK_ATTENTION_FUNCTIONS else sdpa_mask
        AttentionMaskInterface.register(name, mask)
    return name


def set_attention(model: torch.nn.Module, attention_names: list[str], implementation: str) -> str:
    """Routes the attention of `model` through `implementation` (one of the two above), which then calls the
    model's configured implementation; returns the previous name so that it can be restored."""
    previous = model.config._attn_implementation
    base = (
        getattr(model.get_submodule(attention_names[0]), "trl_fp8_base_attention", previous)
        if attention_names
        else previous
    )
    for name in attention_names:
        model.get_submodule(name).trl_fp8_base_attention = base
    model.config._attn_implementation = _registered(implementation, base)
    return previous


@contextmanager
def _recording_queries(model: torch.nn.Module):
    global _query_amax
    previous = set_attention(model, attention_module_names(model), RECORD_QUERY_ATTENTION)
    _query_amax = {}
    try:
        yield _query_amax
    finally:
        _query_amax = None
        model.config._attn_implementation = previous


class KVAmaxRecorder(DynamicCache):
    """A `DynamicCache` that records, for every layer, the per-token amax of the keys and values it stores. With
    `config` its layers are built from the model's layer types (which a model with recurrent layers needs)."""

    def __init__(self, config=None):
        super().__init__(config=config)
        self.token_amax: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # (B, H, T, D) -> (B, T): the largest magnitude any head stores for each token
        self.token_amax[layer_idx] = (
            key_states.detach().abs().amax(dim=(1, 3)).float(),
            value_states.detach().abs().amax(dim=(1, 3)).float(),
        )
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


@torch.no_grad()
def calibrate_kv_scales(
    decoder: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    percentile: float = 99.9,
    margin: float = 1.05,
) -> torch.Tensor:
    """Runs `decoder` (the base model, without its LM head; or a causal LM, or its PEFT wrapper, whose LM head then
    runs on the last position only) on a calibration batch and returns the (num_layers, 3) fp32 tensor of K, V and Q
    dequant multipliers (after RoPE, as the cache and the attention kernel see them), from the padding-free tokens
    only. The forward runs in eval mode (the training modes are restored after)."""
    if not bool(attention_mask.any()):
        raise ValueError(
            "FP8 KV cache calibration: the calibration batch's attention_mask masks every token; there is nothing "
            "to measure the Q/K/V scales on"
        )
    config = getattr(decoder, "config", None)
    sources = kv_shared_sources(config) if config is not None else {}
    recorder = KVAmaxRecorder(config if config is not None and recurrent_layers(config) else None)
    # A measurement takes no dropout; and transformers < 5.24 drops the cache of a training model under gradient
    # checkpointing even without grad (TRL's default), which would leave nothing recorded.
    modes = {m: m.training for m in decoder.modules()}
    decoder.eval()
    try:
        with _recording_queries(decoder) as query_amax:
            kwargs = {CACHE_KWARG: recorder}
            if getattr(decoder, "get_output_embeddings", lambda: None)() is not None:
                kwargs["logits_to_keep"] = 1
                # With the last logits alone, Gemma 4 runs its KV-shared layers on the last positions only; asking
                # for the hidden states keeps every position there, so their queries are measured on all tokens.
                if sources:
                    kwargs["output_hidden_states"] = True
            decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=True, **kwargs)
    finally:
        for module, training in modes.items():
            module.training = training
    # A layer that reads another layer's K/V stores none; its K/V are that layer's codes (`kv_shared_sources`).
    for layer, source in sources.items():
        if layer not in recorder.token_amax and source in recorder.token_amax:
            recorder.token_amax[layer] = recorder.token_amax[source]
    if sorted(recorder.token_amax) != sorted(query_amax):
        raise RuntimeError(
            f"FP8 KV cache calibration: the forward stored K/V for layers {sorted(recorder.token_amax)} of "
            f"{sorted(query_amax)}; the model does not fill the cache it is given"
        )
    valid = attention_mask.bool()
    scale_invs = [
        [kv_scale_inv_from_amax(amax[valid], percentile, margin) for amax in (*recorder.token_amax[i], query_amax[i])]
        for i in sorted(recorder.token_amax)
    ]
    return torch.tensor(scale_invs, dtype=torch.float32)
