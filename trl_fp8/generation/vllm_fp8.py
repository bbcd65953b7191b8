"""Colocated vLLM in DeepSeek-style block FP8, refitted every optimizer step with the learner's own FP8 weights and
scales (`trl_fp8.quant.export`'s stream), so that the sampler's weight grid is the learner's bit for bit.

`FP8VLLMGeneration` is TRL's `VLLMGeneration` with two choke points wrapped, nothing copied:

- `_init_vllm`: TRL builds the `LLM` (TP groups, environment, sleep mode) with this module's arguments merged in:
  `quantization="fp8"`, `hf_overrides={"quantization_config": <block 128x128, dynamic, e4m3, ignored_layers>}`,
  `load_format="dummy"` (the first sync fills the weights), `kv_cache_dtype="fp8"` with an FP8 KV cache, and the
  user's `vllm_llm_kwargs`. `VLLM_USE_DEEP_GEMM_E8M0` follows the recipe's `pow2_scales`: with fp32 scales vLLM
  keeps the learner's bytes; with pow2 scales its DeepGEMM E8M0 path may renormalize a block (codes times 2^k,
  scale over 2^k), which represents the very same values, except in a block whose largest magnitude is below 1e-4:
  DeepGEMM's re-quantization clamps the amax there (`per_block_cast_to_fp8`), and serves it on a coarser grid.
- `sync_weights`: the checkpoint-format stream (`...weight` e4m3 + `...weight_scale_inv` fp32, BF16 for the rest,
  Q/K/V scales) goes through vLLM's in-place layerwise reload (`model_runner.reload_weights(weights_iterator=...,
  is_checkpoint_format=True)` under the engine's config, as 0.31's `Worker.reload_weights` runs it), which fuses
  q/k/v and gate/up with vLLM's own loaders and copies into the original storage; then the prefix and encoder caches
  go. The stream is validated before the engine is touched. With sleep mode the weights are woken first (never a bare
  reload, which would restore the disk checkpoint: trl#5312); TRL's `generate` wakes the KV cache.

Every vLLM symbol used here was read in the source of vLLM 0.22.0 and 0.31.0 (the `vllm` extra's range).
"""

import logging
import os
import re
import time

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from trl.generation.vllm_generation import VLLMGeneration, empty_cache

from ..quant.checkpoint_names import checkpoint_module_names
from ..quant.export import refuse_nonfinite, stream_checkpoint_names, stream_nbytes
from ..quant.kv_cache import check_kv_cache_supported
from .gather import learner_gather
from .reference import refuse_reserved
from .stream import LearnerStream
from .vllm_layout import check_vllm_fp8_layers, vllm_nested_prefix_maps, with_nested_renames
from .vllm_refit import check_reload_complete, refit


logger = logging.getLogger(__name__)


VLLM_SPECIFIER = ">=0.22.0,<=0.31.0"  # the `vllm` extra of pyproject.toml; tested to agree

# `LLM(...)` arguments the engine owns, and where to set them instead.
RESERVED_LLM_KWARGS = {
    "model": "the model given to FP8GRPOTrainer (loaded from a local folder or the Hub)",
    "quantization": "fp8_recipe: the engine always serves the recipe's block FP8",
    "load_format": "nothing: the engine starts empty (`dummy`) and the first sync fills it",
    "seed": "FP8GRPOConfig.seed",
    "distributed_executor_backend": "nothing: colocation needs `external_launcher`",
    "tensor_parallel_size": "FP8GRPOConfig.vllm_tensor_parallel_size",
    "gpu_memory_utilization": "FP8GRPOConfig.vllm_gpu_memory_utilization",
    "max_model_len": "FP8GRPOConfig.vllm_max_model_length",
    "max_num_seqs": "per_device_train_batch_size and steps_per_generation",
    "enable_sleep_mode": "FP8GRPOConfig.vllm_enable_sleep_mode",
    "model_impl": "FP8GRPOConfig.vllm_model_impl",
    "logprobs_mode": "nothing: importance sampling needs `processed_logprobs`",
    "kv_cache_dtype": "FP8GRPOConfig.fp8_kv_cache",
    "trust_remote_code": "FP8GRPOConfig.trust_remote_code",
    # A draft model (or an MTP head) starts from `dummy`'s random weights too, and the refit never reaches it.
    "speculative_config": "nothing: the refit loads the policy only; a draft model would propose from random weights",
}


def check_llm_kwargs(user_kwargs: dict | None) -> dict:
    """Refuses `vllm_llm_kwargs` keys the engine owns, naming what to set instead; returns a copy."""
    user_kwargs = refuse_reserved("vllm_llm_kwargs", user_kwargs, RESERVED_LLM_KWARGS)
    hf_overrides = user_kwargs.get("hf_overrides")
    if hf_overrides is not None and not isinstance(hf_overrides, dict):
        raise ValueError(
            "vllm_llm_kwargs['hf_overrides'] must be a dict here (FP8GRPOTrainer adds the quantization_config to it)"
        )
    if "quantization_config" in (hf_overrides or {}):
        raise ValueError(
            "vllm_llm_kwargs['hf_overrides']['quantization_config'] is set by FP8GRPOTrainer from fp8_recipe."
        )
    return user_kwargs


def check_vllm_version(version: str | None = None) -> str:
    """Raises an `ImportError` unless vLLM (or `version`) is inside the supported range; returns the version."""
    if version is None:
        try:
            import vllm
        except ImportError as err:
            raise ImportError(
                'use_vllm=True needs vLLM: pip install "trl-fp8[vllm]" (vLLM ' + VLLM_SPECIFIER + ")"
            ) from err
        version = vllm.__version__
    if Version(version).base_version not in SpecifierSet(VLLM_SPECIFIER):
        raise ImportError(
            f"vLLM {version} is outside the range trl-fp8 supports ({VLLM_SPECIFIER}): the refit relies on vLLM's "
            f'layerwise reload and block-FP8 loaders as they are in that range. pip install "vllm{VLLM_SPECIFIER}"'
        )
    return version


def vllm_quantization_config(recipe, ignored_layers: list[str]) -> dict:
    """The `quantization_config` vLLM's `Fp8Config.from_config` reads for DeepSeek-style block FP8."""
    return {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": list(recipe.weight_block_size),
        "ignored_layers": list(ignored_layers),
    }


# vLLM models whose `load_weights` writes some parameters with `param.data.copy_` instead of their `weight_loader`.
# Every refit goes through vLLM's layerwise reload, which keeps parameters on the meta device until their loaders have
# filled them: those writes land nowhere, and vLLM puts its previous values back with no more than a logged warning,
# so the sampler would keep its first weights there (read in vLLM 0.22.0's and 0.31.0's source).
RELOAD_SKIPS = {
    "gpt_oss": "its experts (weights and biases) and attention sinks (gpt_oss.py, `_load_weights_other`)",
    "mimo_v2_flash": "its attention sinks, `attention_sink_bias` on disk (mimo_v2.py, `load_weights`)",
}


def check_reloadable(config) -> None:
    """Refuses an architecture whose weights vLLM's layerwise reload would leave stale (`RELOAD_SKIPS`)."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(text_config, "model_type", None)
    if model_type in RELOAD_SKIPS:
        raise NotImplementedError(
            f"fp8_generation with vLLM cannot refit {model_type} models: vLLM's layerwise reload does not load "
            f"{RELOAD_SKIPS[model_type]}, so the sampler would keep stale weights. Use fp8_generation=False (TRL's "
            "own BF16 vLLM engine) or use_vllm=False (trl-fp8's FP8 reference engine)."
        )


def vllm_architectures(path: str, vllm_llm_kwargs: dict | None) -> list[str] | None:
    """The architectures vLLM builds for `path`: its raw `config.json`'s (read without running remote code), unless
    the user's `hf_overrides` set them."""
    from transformers import PretrainedConfig

    overrides = (vllm_llm_kwargs or {}).get("hf_overrides") or {}
    if "architectures" in overrides:
        return overrides["architectures"]
    return PretrainedConfig.get_config_dict(path)[0].get("architectures")


def check_architecture(policy, architectures: list[str] | None) -> None:
    """Refuses a text policy loaded from a vision-language checkpoint (Qwen3.5's, whose text model transformers'
    `AutoModelForCausalLM` gives): vLLM builds the multimodal model its `config.json` names, which expects
    `model.language_model.*` where the policy streams `model.layers.*`, so every refit would miss them."""
    name = type(policy).__name__
    multimodal = [a for a in architectures or () if a.endswith("ForConditionalGeneration")]
    if multimodal and name not in multimodal:
        raise ValueError(
            f"vLLM builds {multimodal[0]} from {policy.name_or_path}'s config.json, but the policy is {name}, whose "
            f"weights are named otherwise: the FP8 refit would not find them. Save the policy as it is "
            "(`model.save_pretrained(folder)`, with its tokenizer) and pass that folder as the model."
        )


def fp8_llm_kwargs(
    model,
    recipe,
    *,
    tp_size: int = 1,
    kv_cache: bool = False,
    user_kwargs: dict | None = None,
    vllm_version: str | None = None,
):
    """What `FP8VLLMGeneration` adds to TRL's `LLM(...)` arguments for `model` (the unwrapped learner) and the
    installed `vllm_version`."""
    if tuple(recipe.weight_block_size) != (128, 128):
        raise ValueError(f"vLLM serves block FP8 in 128x128 blocks; fp8_recipe has {recipe.weight_block_size}")
    check_reloadable(model.config)
    user_kwargs = check_llm_kwargs(user_kwargs)
    ignored = check_vllm_fp8_layers(model, recipe, tp_size)
    hf_overrides = dict(user_kwargs.pop("hf_overrides", None) or {})
    # vLLM names its modules as the checkpoint does (Mixtral's `block_sparse_moe`, not transformers' `mlp`).
    ignored = checkpoint_module_names(model, ignored, prefixes=False)
    ignored = with_nested_renames(
        ignored, vllm_nested_prefix_maps(getattr(model.config, "architectures", None) or [type(model).__name__])
    )
    hf_overrides["quantization_config"] = vllm_quantization_config(recipe, ignored)
    kwargs = {**user_kwargs, "quantization": "fp8", "hf_overrides": hf_overrides, "load_format": "dummy"}
    if kv_cache:
        check_kv_cache_supported(model)
        kwargs["kv_cache_dtype"] = "fp8"
    if getattr(model.config, "kv_lora_rank", None) and vllm_version and Version(vllm_version) < Version("0.31.0"):
        # Before 0.31 MLA re-derives W_UV / W_UK_T as new tensors at every reload (0.31 copies them in place): a
        # captured CUDA graph would keep reading the old ones after each refit.
        if user_kwargs.get("enforce_eager") is False:
            raise ValueError(
                f"vLLM {vllm_version} with multi-head latent attention needs enforce_eager=True under refits (its "
                "CUDA graphs would keep reading the first weights); drop enforce_eager=False or use vLLM >= 0.31.0"
            )
        if "enforce_eager" not in user_kwargs:
            logger.warning("trl-fp8: vLLM %s runs multi-head latent attention eagerly under refits", vllm_version)
        kwargs["enforce_eager"] = True
    return kwargs


def deep_gemm_e8m0_env(recipe) -> str:
    """`VLLM_USE_DEEP_GEMM_E8M0` for the recipe: vLLM re-rounds non-pow2 scales to powers of two unless it is "0"."""
    wanted = "1" if recipe.pow2_scales else "0"
    current = os.environ.get("VLLM_USE_DEEP_GEMM_E8M0")
    if current is not None and current != wanted:
        raise ValueError(
            f"VLLM_USE_DEEP_GEMM_E8M0={current} disagrees with fp8_recipe.pow2_scales={recipe.pow2_scales}: vLLM "
            f"would {'re-round the trainer scales' if current == '1' else 'serve pow2 scales as fp32'}. "
            f"Unset it, or set it to {wanted}."
        )
    return wanted


def validate_stream(pairs: list[tuple[str, torch.Tensor]], expected: dict | None) -> dict:
    """Checks a stream before any of it reaches the engine; returns its `{name: (shape, dtype)}`.

    Every e4m3 tensor must come with its `_scale_inv`, every `...weight_scale_inv` finite and positive beside an
    e4m3 `...weight` whose shape it covers in 128x128 blocks, every high-precision tensor and KV scale finite, and,
    from the second sync on, names, shapes and dtypes exactly those of the first (vLLM's reload would otherwise fail
    half-way, or leave tensors unloaded).
    """
    meta = {name: (tuple(t.shape), t.dtype) for name, t in pairs}
    if len(meta) != len(pairs):
        raise ValueError("the sync stream names a tensor twice")
    if expected is not None and meta != expected:
        missing, extra = sorted(set(expected) - set(meta)), sorted(set(meta) - set(expected))
        changed = sorted(n for n in set(meta) & set(expected) if meta[n] != expected[n])
        raise ValueError(
            f"the sync stream changed since the first sync: missing {missing[:3]}, unexpected {extra[:3]}, "
            f"changed {[(n, expected[n], meta[n]) for n in changed[:3]]}"
        )
    for name, t in pairs:
        if t.dtype == torch.float8_e4m3fn and f"{name}_scale_inv" not in meta:  # vLLM would keep its old scales
            raise ValueError(f"{name} is float8_e4m3fn without its {name}_scale_inv in the sync stream")
        if name.endswith(".weight_scale_inv"):
            weight = name.removesuffix("_scale_inv")
            if weight not in meta or meta[weight][1] != torch.float8_e4m3fn:
                raise ValueError(f"{name} has no float8_e4m3fn {weight} beside it in the sync stream")
            n, k = meta[weight][0][-2:]
            if tuple(t.shape[-2:]) != (-(-n // 128), -(-k // 128)) or t.dtype != torch.float32:
                raise ValueError(f"{name} is {t.dtype} {tuple(t.shape)}; {weight} {n}x{k} needs fp32 128x128 blocks")
    refuse_nonfinite(pairs)
    return meta


# Attention implementations that do not read the K/V/Q scales from the tensors each refit updates in place: vLLM
# 0.22-0.31's FlashInfer backend computes its bmm1/bmm2 scales once, at its first forward (flashinfer.py), and its
# other paths pass the host floats, which captured CUDA graphs freeze. The FP8 KV cache would then decode with the
# scales of vLLM's dummy weights. (FlashAttention and Triton read the tensors; the CPU backend reads the host floats,
# which each reload sets again, and captures no graphs.)
STALE_KV_SCALE_IMPLS = ("FlashInferImpl",)


def _impl_name(impl) -> str:
    # A composite backend (vLLM 0.31's TRITON_FLASHINFER on Blackwell) runs the implementations it wraps.
    inner = [type(getattr(impl, a)).__name__ for a in ("general_impl", "causal_impl") if hasattr(impl, a)]
    return f"{type(impl).__name__}({', '.join(inner)})" if inner else type(impl).__name__


def attention_impls(model) -> dict[str, str]:
    """Runs on each vLLM worker (`LLM.apply_model`): the implementation class of every attention layer, by name
    (a composite one's as `Outer(General, Causal)`)."""
    return {name: _impl_name(m.impl) for name, m in model.named_modules() if hasattr(m, "impl")}


def check_kv_scale_backend(impls: dict[str, str]) -> None:
    """Refuses an FP8 KV cache on an attention implementation that would keep stale K/V/Q scales."""
    stale = sorted(name for name, impl in impls.items() if set(re.findall(r"\w+", impl)) & set(STALE_KV_SCALE_IMPLS))
    if stale:
        raise ValueError(
            f"fp8_kv_cache: vLLM picked {impls[stale[0]]} for {stale[:3]}{' ...' if len(stale) > 3 else ''}, which "
            "reads the K/V scales once (or from CUDA graphs), not from the tensors each sync updates. Choose a "
            'backend that reads them: vllm_llm_kwargs={"attention_backend": "FLASH_ATTN"} (Hopper) or "TRITON_ATTN".'
        )


class FP8VLLMGeneration(LearnerStream, VLLMGeneration):
    """TRL's colocated `VLLMGeneration`, serving block FP8 refitted from the learner.

    Args:
        model, accelerator, processing_class, **kwargs:
            `VLLMGeneration`'s, as `GRPOTrainer` passes them (`mode` must be `"colocate"`).
        recipe (`FP8Recipe`):
            Block size, scale rule and which linears are FP8 (must match the learner's conversion).
        fp8_kv_cache (`bool`), kv_scale_percentile (`float`), kv_scale_margin (`float`):
            FP8 KV cache, with Q/K/V scales recalibrated from the learner before every sync.
        vllm_llm_kwargs (`dict`, *optional*):
            Extra `vllm.LLM` arguments; the keys of `RESERVED_LLM_KWARGS` are refused.
    """

    def __init__(
        self,
        model,
        accelerator,
        processing_class,
        *,
        recipe,
        fp8_kv_cache: bool = False,
        kv_scale_percentile: float = 99.9,
        kv_scale_margin: float = 1.05,
        vllm_llm_kwargs: dict | None = None,
        **kwargs,
    ):
        self._init_stream(
            model,
            accelerator,
            recipe,
            fp8=True,
            kv_cache=fp8_kv_cache,
            kv_scale_percentile=kv_scale_percentile,
            kv_scale_margin=kv_scale_margin,
        )
        self.vllm_llm_kwargs = check_llm_kwargs(vllm_llm_kwargs)
        self._stream_meta: dict | None = None
        super().__init__(model, accelerator, processing_class, **kwargs)

    def _init_vllm(self) -> None:
        if self.mode != "colocate":
            raise ValueError(f"FP8VLLMGeneration runs colocated vLLM only, got vllm_mode={self.mode!r}")
        version = check_vllm_version()
        policy = self.learner()
        if not getattr(policy, "name_or_path", None):
            raise ValueError(
                "colocated vLLM reads the model's config from `model.name_or_path`, which is empty: save the model "
                "(save_pretrained) and pass its folder to FP8GRPOTrainer"
            )
        check_architecture(policy, vllm_architectures(policy.name_or_path, self.vllm_llm_kwargs))
        # vLLM builds the text model config.json names: its tensors without the multimodal checkpoint's prefix.
        with learner_gather(self.accelerator, self.model) as gather:
            self.checkpoint_names = stream_checkpoint_names(
                policy, self.recipe, self._attn_names, prefixes=False, gather=gather
            )
        overrides = fp8_llm_kwargs(
            policy,
            self.recipe,
            tp_size=self.tensor_parallel_size,
            kv_cache=self.kv_cache,
            user_kwargs=self.vllm_llm_kwargs,
            vllm_version=version,
        )
        os.environ["VLLM_USE_DEEP_GEMM_E8M0"] = deep_gemm_e8m0_env(self.recipe)
        import trl.generation.vllm_generation as trl_vllm

        make_llm = trl_vllm.LLM

        def make_fp8_llm(*args, **trl_kwargs):
            return make_llm(*args, **{**trl_kwargs, **overrides})

        # TRL's `_init_vllm` builds the engine (TP groups, environment, sleep mode); only its arguments change.
        trl_vllm.LLM = make_fp8_llm
        try:
            super()._init_vllm()
        finally:
            trl_vllm.LLM = make_llm
        if self.kv_cache:
            check_kv_scale_backend({k: v for impls in self.llm.apply_model(attention_impls) for k, v in impls.items()})

    def state_stream(self, kv_scale_invs: torch.Tensor | None = None) -> list[tuple[str, torch.Tensor]]:
        return self.checkpoint_names(super().state_stream(kv_scale_invs))

    @torch.no_grad()
    def sync_weights(self) -> None:
        """Refits the engine with the learner's FP8 stream (TRL calls this once per optimizer step)."""
        kv_scale_invs, calibration_seconds = self._sync_kv_scales()
        start = time.perf_counter()
        pairs = self.state_stream(kv_scale_invs)
        self._stream_meta = validate_stream(pairs, self._stream_meta)
        sent, bf16 = stream_nbytes(pairs)
        if self.enable_sleep_mode and self._llm_weights_sleeping:
            # Only while asleep (a second sync without a generation between them, a `rollout_func`, finds them
            # awake). Awake from here on, even if the reload fails: the flag must say so, or the next sync would wake
            # them again.
            empty_cache()
            self.llm.wake_up(tags=["weights"])
            self._llm_weights_sleeping = False
        unloaded = refit(self.llm, pairs, sleep_mode=self.enable_sleep_mode)
        check_reload_complete(unloaded, kv_cache=self.kv_cache)
        self._hold_kv_scales(kv_scale_invs)
        self.last_sync = {"seconds": time.perf_counter() - start, "bytes": sent, "bf16_bytes": bf16}
        if self.kv_cache:
            self.last_sync["kv_calibration_seconds"] = calibration_seconds
