import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from trl import GRPOConfig

from ..recipe import FP8Recipe


@dataclass
class FP8GRPOConfig(GRPOConfig):
    # docstyle-ignore
    r"""
    Configuration class for [`FP8GRPOTrainer`]: every [`trl.GRPOConfig`] parameter, plus the FP8 recipe.

    Sampling always runs in an engine separate from the learner, so the learner/sampler mismatch is real and TRL's
    importance-sampling correction applies to it: colocated vLLM in block FP8 with `use_vllm=True` (the production
    path, GPU only), or else trl-fp8's reference engine, which runs the same numerics anywhere.

    Parameters:
        > Parameters that control FP8

        fp8_recipe (`FP8Recipe`, `dict`, `str` or `None`, *optional*, defaults to `None`):
            The FP8 recipe: an [`FP8Recipe`], a dict of its fields (or that dict as a JSON string, from the command
            line), a path to a recipe file / a folder holding `fp8_recipe.json`, or a Hub id of such a folder.
            An `FP8Recipe` or a dict is stored as the dict of its fields (JSON, as `TrainingArguments` saves itself).
            `None` means `FP8Recipe()`:
            E4M3, 128x128 weight blocks, 1x128 activation blocks, fp32 scales.
        fp8_training (`bool`, *optional*, defaults to `True`):
            Run the learner's decoder linears in FP8 (forward, and both backward GEMMs). The old-logprob and
            reference-model passes run in the same numerics, so the PPO ratio is ~1 on-policy.
        fp8_generation (`bool`, *optional*, defaults to `True`):
            Sample with W8A8 block-FP8 linears whose weights and scales are the learner's own quantization (or the
            recipe's quantization of the learner's weights when `fp8_training=False`: "FP8 generation only"). Needs
            the recipe's 128x128 weight blocks, the only ones vLLM serves.
        fp8_kv_cache (`bool`, *optional*, defaults to `False`):
            Sample with an FP8 (E4M3) KV cache, half the memory of BF16, and FP8 queries (as vLLM's FP8-KV attention
            runs). Its per-layer Q/K/V scales are recalibrated from the updated learner after every optimizer step (a
            no-grad forward of the learner's decoder on a small slice of the latest batch) and travel in the sync
            stream in vLLM's names (`k_scale`, `v_scale`, `q_scale`). Requires `fp8_generation`; refused for
            multi-head latent attention (DeepSeek-V3, Moonlight), whose cache vLLM stores as a compressed latent.
        fp8_kv_scale_percentile (`float`, *optional*, defaults to `99.9`):
            Percentile, over tokens, of the per-token K/V amax that sets each layer's scale.
        fp8_kv_scale_margin (`float`, *optional*, defaults to `1.05`):
            Headroom multiplied onto that percentile, so that the policy can drift before values saturate.
        fp8_kv_calibration_rows (`int`, *optional*, defaults to `16`):
            Sequences of the latest batch (prompt and completion) that the KV recalibration forward runs on, spread
            evenly over the batch so that they come from as many prompts as possible.
        fp8_save_format (`str`, *optional*, defaults to `"bf16"`):
            What `trainer.save_model()` writes: `"bf16"`, the high-precision master weights (a regular checkpoint), or
            `"fp8"`, a block-FP8 checkpoint (the sampler's e4m3 weights + `weight_scale_inv`, with a
            `quantization_config` that vLLM and transformers' `FineGrainedFP8Config` read). Intermediate checkpoints
            (`save_steps`) always hold the master weights, so `resume_from_checkpoint` continues exactly.
        fp8_mismatch_metrics (`bool`, *optional*, defaults to `True`):
            Log `sampling/token_mult_prob_error`, `sampling/gen_kl` and `sampling/is_oob_ratio` every step. With
            `vllm_importance_sampling_correction=False` this costs one extra no-grad forward per generation batch,
            unless TRL computes the old log-probs anyway (`gradient_accumulation_steps` not a multiple of
            `steps_per_generation * num_iterations`).
        vllm_llm_kwargs (`dict`, `str` or `None`, *optional*, defaults to `None`):
            Extra keyword arguments for `vllm.LLM(...)` when `use_vllm=True` (a JSON string from the command line),
            e.g. `{"enforce_eager": true, "max_num_batched_tokens": 8192}`. The keys the engine sets itself (model,
            quantization, load_format, seed, tensor_parallel_size, kv_cache_dtype, ...) are refused with the config
            field to use instead, and so is `speculative_config` (the refit never reaches a draft model). Only
            `vllm_mode="colocate"` is supported. Refused unless `use_vllm=True` and `fp8_generation=True`: with
            `fp8_generation=False` TRL's own BF16 vLLM engine samples (no `fp8/sync_*` metrics), configured by TRL's
            `vllm_*` fields.

        > Parameters of [`trl.GRPOConfig`] whose defaults change

        vllm_importance_sampling_mode (`str`, *optional*, defaults to `"token_truncate"`):
            Token-level truncated importance sampling, the FP8 recipe's correction (NeMo RL, verl, slime).
        vllm_importance_sampling_clip_max (`float` or `None`, *optional*, defaults to `2.0`):
            The truncation cap C of token-level TIS that NeMo RL, verl and slime use (`None`: no upper cap, as in
            TRL).

    The importance-sampling fields keep their TRL names (`vllm_importance_sampling_*`) but apply to whichever
    engine samples.
    """

    fp8_recipe: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "The FP8 recipe: a dict of FP8Recipe fields (a JSON string on the command line), a path to a "
            "recipe file or a folder holding fp8_recipe.json, or a Hub id of such a folder. Defaults to FP8Recipe()."
        },
    )
    fp8_training: bool = field(
        default=True,
        metadata={"help": "Run the learner's decoder linears in FP8 (forward, dgrad and wgrad)."},
    )
    fp8_generation: bool = field(
        default=True,
        metadata={"help": "Sample with W8A8 block-FP8 linears holding the learner's own FP8 weights and scales."},
    )
    fp8_kv_cache: bool = field(
        default=False,
        metadata={
            "help": "Sample with an FP8 KV cache whose per-layer scales are recalibrated from the learner every "
            "optimizer step. Requires fp8_generation."
        },
    )
    fp8_kv_scale_percentile: float = field(
        default=99.9,
        metadata={"help": "Percentile, over tokens, of the per-token K/V amax that sets each layer's KV scale."},
    )
    fp8_kv_scale_margin: float = field(
        default=1.05,
        metadata={"help": "Headroom multiplied onto the K/V amax percentile before dividing by 448."},
    )
    fp8_kv_calibration_rows: int = field(
        default=16,
        metadata={"help": "Sequences of the latest batch that the KV-scale recalibration forward runs on."},
    )
    fp8_save_format: str = field(
        default="bf16",
        metadata={
            "help": "What save_model() writes: 'bf16' (the master weights) or 'fp8' (a block-FP8 checkpoint that vLLM "
            "and transformers load). Intermediate checkpoints always hold the master weights.",
            "choices": ["bf16", "fp8"],
        },
    )
    fp8_mismatch_metrics: bool = field(
        default=True,
        metadata={
            "help": "Log sampling/token_mult_prob_error, sampling/gen_kl and sampling/is_oob_ratio every step "
            "(one extra forward per generation batch when the importance-sampling correction is off)."
        },
    )
    vllm_llm_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "Extra keyword arguments for vllm.LLM(...) with use_vllm=True (a JSON string on the command "
            'line), e.g. {"enforce_eager": true}. Keys FP8GRPOTrainer sets itself (model, quantization, seed, ...) '
            "are refused with the config field to use instead."
        },
    )
    vllm_importance_sampling_mode: str = field(
        default="token_truncate",
        metadata={
            "help": "Importance-sampling mode: 'token_truncate' (the FP8 recipe's default), 'token_mask', "
            "'sequence_truncate' or 'sequence_mask'."
        },
    )
    vllm_importance_sampling_clip_max: float | None = field(
        default=2.0,
        metadata={"help": "Importance-sampling cap C_max; 2.0 is the token-level TIS cap of the FP8 recipe."},
    )

    def __post_init__(self):
        super().__post_init__()
        # First: the checks below read them as flags, and "false" from a Python caller would read as True.
        for name in ("fp8_training", "fp8_generation", "fp8_kv_cache", "fp8_mismatch_metrics"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        recipe = self.fp8_recipe
        if isinstance(recipe, str) and recipe.lstrip().startswith("{"):
            recipe = _json_field("fp8_recipe", recipe)
        try:
            self._fp8_recipe = FP8Recipe.from_any(recipe)
        except ValueError as err:
            raise ValueError(f"fp8_recipe: {err}") from err
        if not isinstance(self.fp8_recipe, str):
            self.fp8_recipe = self._fp8_recipe.to_dict()  # JSON-native, so TrainingArguments can serialize it
        if self.fp8_generation and self._fp8_recipe.weight_block_size != [128, 128]:
            raise ValueError(
                f"fp8_recipe.weight_block_size {self._fp8_recipe.weight_block_size} needs fp8_generation=False: the "
                "FP8 samplers (vLLM's block-FP8 kernels and the reference engine) take 128x128 weight blocks only"
            )
        if not self.use_vllm and isinstance(self.generation_kwargs, dict):
            from ..generation.reference import check_generation_kwargs

            check_generation_kwargs(self.generation_kwargs)
        if self.fp8_save_format not in ("bf16", "fp8"):
            raise ValueError(f"fp8_save_format must be 'bf16' or 'fp8', got {self.fp8_save_format!r}")
        if self.fp8_kv_cache and not self.fp8_generation:
            raise ValueError(
                "fp8_kv_cache=True needs fp8_generation=True: the FP8 KV cache belongs to the FP8 sampler."
            )
        if not (_is_real(self.fp8_kv_scale_percentile) and 0 < self.fp8_kv_scale_percentile <= 100):
            raise ValueError(f"fp8_kv_scale_percentile must be in (0, 100], got {self.fp8_kv_scale_percentile!r}")
        if not (_is_real(self.fp8_kv_scale_margin) and 0 < self.fp8_kv_scale_margin < math.inf):
            raise ValueError(f"fp8_kv_scale_margin must be positive and finite, got {self.fp8_kv_scale_margin!r}")
        rows = self.fp8_kv_calibration_rows
        if not (isinstance(rows, int) and not isinstance(rows, bool) and rows >= 1):
            raise ValueError(f"fp8_kv_calibration_rows must be an int, at least 1, got {rows!r}")
        self._check_importance_sampling()
        if isinstance(self.vllm_llm_kwargs, str):
            self.vllm_llm_kwargs = _json_field("vllm_llm_kwargs", self.vllm_llm_kwargs)
        if self.vllm_llm_kwargs is not None and not isinstance(self.vllm_llm_kwargs, dict):
            raise ValueError(
                f"vllm_llm_kwargs must be a dict (or its JSON), got {type(self.vllm_llm_kwargs).__name__}"
            )
        if self.vllm_llm_kwargs is not None:
            from ..generation.vllm_fp8 import check_llm_kwargs

            check_llm_kwargs(self.vllm_llm_kwargs)
            if not self.use_vllm:
                raise ValueError("vllm_llm_kwargs is set but use_vllm=False: set use_vllm=True to sample with vLLM.")
            if not self.fp8_generation:
                raise ValueError(
                    "vllm_llm_kwargs is set but fp8_generation=False: TRL's own BF16 vLLM engine samples then, and it "
                    "takes its arguments from TRL's vllm_* fields (e.g. vllm_gpu_memory_utilization)."
                )
        if self.use_vllm and self.vllm_mode != "colocate":
            raise ValueError(
                f"vllm_mode={self.vllm_mode!r} is not supported by FP8GRPOTrainer: TRL's server client sends BF16 "
                "weights for the server to re-quantize, not the learner's FP8 weights and scales. Use "
                "vllm_mode='colocate' (vLLM in the training processes), or use_vllm=False (the FP8 reference engine)."
            )
        if self.fp8_kv_cache and not self.use_vllm and self.cache_implementation is not None:
            raise ValueError(
                f"cache_implementation={self.cache_implementation!r} conflicts with fp8_kv_cache=True: the reference "
                "engine decodes with its own FP8 KV cache. Unset cache_implementation, or set fp8_kv_cache=False."
            )
        if self.use_transformers_continuous_batching:
            # TRL's deprecated use_transformers_paged sets use_transformers_continuous_batching: name the one set.
            name = "use_transformers_paged" if self.use_transformers_paged else "use_transformers_continuous_batching"
            raise ValueError(
                f"{name}=True conflicts with FP8GRPOTrainer's sampling engine; set it to False (FP8GRPOTrainer always "
                "samples with its own engine)."
            )
        zero3 = self.deepspeed_plugin is not None and self.deepspeed_plugin.zero_stage == 3
        if zero3 and not self.ds3_gather_for_generation and not self.use_vllm:
            raise ValueError(
                "ds3_gather_for_generation=False asks to generate from ZeRO-3's partitioned weights, which the FP8 "
                "reference engine (use_vllm=False) does not do: like vLLM (for which TRL does not take this setting "
                "either) it samples from a whole copy of the policy on every process, its linears in FP8. Set "
                "ds3_gather_for_generation=True (the default)."
            )
        if (
            self.loss_type == "vespo"
            and self.vllm_importance_sampling_correction
            and self.vllm_importance_sampling_mode not in ("token_truncate", "token_mask")
        ):
            raise ValueError(
                "loss_type='vespo' needs vllm_importance_sampling_mode 'token_truncate' or 'token_mask', got "
                f"{self.vllm_importance_sampling_mode!r}."
            )

    def _check_importance_sampling(self) -> None:
        """TRL reads the mode and the caps at the first generation, after loading the models, and accepts a negative
        cap (which flips the sign of every token's weight): refused here, naming the field."""
        if self.vllm_importance_sampling_mode not in IS_MODES:
            raise ValueError(
                f"vllm_importance_sampling_mode must be one of {IS_MODES}, got {self.vllm_importance_sampling_mode!r}"
            )
        for name in ("vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min"):
            value = getattr(self, name)
            if value is None:
                continue
            is_max = name.endswith("max")
            if not (_is_real(value) and (value > 0 if is_max else value >= 0) and value < math.inf):
                bound = "positive" if is_max else "non-negative"
                raise ValueError(f"{name} must be {bound} and finite (or None), got {value!r}")

    @property
    def resolved_fp8_recipe(self) -> FP8Recipe:
        """The `FP8Recipe` that `fp8_recipe` describes."""
        return self._fp8_recipe


IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")  # TRL's, read in its trainer


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _json_field(field_name: str, text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{field_name} is not valid JSON ({err.msg} at char {err.pos}): {text!r}") from err
