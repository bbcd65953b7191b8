import inspect
import logging
import warnings
from contextlib import contextmanager
from functools import partial, wraps

import torch
import trl.trainer.grpo_trainer as trl_grpo
from accelerate.utils import is_peft_model
from torch import nn
from transformers.trainer import Trainer
from trl import GRPOTrainer
from trl.import_utils import is_vllm_available
from trl.trainer.utils import get_config_model_id

from ..generation.gather import learner_gather
from ..generation.reference import ReferenceEngine
from ..generation.vllm_colocate import restore_module_call
from ..generation.vllm_fp8 import FP8VLLMGeneration, check_vllm_version
from ..quant.adapters import unwrap_peft
from ..quant.backends import resolve_backend
from ..quant.convert import convert_to_fp8, fp8_modules
from ..quant.export import stream_checkpoint_names
from ..quant.lora import check_peft_supported, convert_lora_layers
from ..quant.te_linear import is_te_linear
from .checkpoints import load_converted_checkpoint
from .checks import (
    check_backend_runs_here,
    check_fp8_architecture,
    check_fp8_kv_cache,
    check_fsdp_supported,
    check_not_converted,
    check_not_quantized,
    check_peft_config,
    check_peft_targets,
    check_text_prompts,
    warn_emulated_on_gpu,
    warn_truncated_sampling,
)
from .fp8_grpo_config import FP8GRPOConfig
from .kv_calibration import (
    calibration_file,
    load_calibration_batch,
    prompts_batch,
    rollouts_batch,
    save_calibration_batch,
)
from .mismatch import MismatchMetrics
from .saving import FP8Saving
from .sharded import (
    prepare_for_fsdp2,
    prepare_for_zero3,
    reference_converted_before_wrapping,
    sharding,
    training_device,
)


logger = logging.getLogger(__name__)


class FP8GRPOTrainer(FP8Saving, MismatchMetrics, GRPOTrainer):
    """
    [`trl.GRPOTrainer`] with FP8 in both generation and training (NVIDIA NeMo RL's end-to-end FP8 recipe).

    Same constructor as [`trl.GRPOTrainer`]; pass an [`FP8GRPOConfig`]. What changes w.r.t. `GRPOTrainer`:

    - `__init__`: converts the policy's decoder linears to `FP8Linear` with the recipe (and the reference model's when
      `beta > 0`, so the KL is measured in the same numerics). Every forward TRL runs for new, old and reference
      log-probs therefore runs in FP8. The sampling engine sits in TRL's slot (`self.vllm_generation`): with
      `use_vllm=True`, GRPOTrainer builds `FP8VLLMGeneration` (colocated vLLM in block FP8, refitted with the
      learner's own FP8 weights and scales) where it builds its `VLLMGeneration`; otherwise the FP8 reference
      engine. TRL syncs the engine after each optimizer step and applies its importance-sampling correction
      (`vllm_importance_sampling_*`) to the engine's log-probs.
    - `_generate_and_score_completions`: calls TRL's, then logs the mismatch metrics NeMo RL and verl log
      (`sampling/token_mult_prob_error`, `sampling/gen_kl`, `sampling/is_oob_ratio`) and the sync cost
      (`fp8/sync_seconds`, `fp8/sync_bytes`, `fp8/sync_bf16_bytes`, with training even when an evaluation ran the
      refit, on their own after an evaluation no training log follows; `fp8/kv_calibration_seconds` with the FP8
      KV cache), `fp8/backend/<name>` (the learner's kernels); for
      MoE models with the reference engine, `fp8/router_mismatch`, the share of (token, layer) pairs whose top-k
      experts differ between sampler and learner on the same sequences.
    - `_generate_single_turn`: with the FP8 KV cache, hands the engine its very first calibration batch, rows of
      the prompts TRL is about to sample (TRL syncs the engine there).
    - `train`: makes TRL refit the engine before a second `train()` call's first generation.
    - `save_model`, `push_to_hub`, `create_model_card` (`trl_fp8.trainers.saving.FP8Saving`): with
      `fp8_save_format="fp8"`, the block-FP8 checkpoint of the export stream, uploaded as such; the recipe
      (`fp8_recipe.json`) beside the weights; the model card's FP8 section.

    On sharded parameters (DeepSpeed ZeRO-3, FSDP2) the sibling linears run alone, no FP8 weight is cached, and the
    reference model is converted before DeepSpeed or FSDP wraps it (`trl_fp8.trainers.sharded`); under ZeRO-3 FP8
    LoRA layers are gathered with their base layers. The stream to the sampler gathers one module at a time (FSDP2:
    one unit). FSDP1 is refused.

    The loss, the IS correction, the optimizer and the sync schedule are TRL's, unchanged.
    """

    _tag_names = ["trl", "grpo", "fp8"]
    _name = "FP8 GRPO"

    def __init__(self, model, reward_funcs=None, args: FP8GRPOConfig | None = None, *more, **kwargs):
        # GRPOTrainer's other parameters, passed by position or by name, by name: the checks below read them.
        kwargs = _by_name(model, reward_funcs, args, more, kwargs)
        if args is None:
            model_name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = FP8GRPOConfig(f"{model_name.split('/')[-1]}-FP8-GRPO")
        elif not isinstance(args, FP8GRPOConfig):
            raise TypeError(
                f"FP8GRPOTrainer needs an FP8GRPOConfig, got {type(args).__name__}: replace GRPOConfig(...) by "
                "FP8GRPOConfig(...) with the same arguments."
            )
        # Before TRL loads the policy, reference and reward models (minutes at 8B, on every rank).
        if args.use_vllm and args.fp8_generation:
            check_vllm_version()
        elif args.use_vllm and not is_vllm_available():
            raise ImportError('use_vllm=True needs vLLM: pip install "trl[vllm]"')
        if kwargs.get("peft_config") is not None:
            check_peft_config(kwargs["peft_config"], args.fp8_training)
            check_peft_targets(model, kwargs["peft_config"], args)
        if not isinstance(model, str) and is_peft_model(model):
            check_peft_supported(model, allow_dropout=not args.fp8_training)
        check_not_quantized(model, kwargs.get("quantization_config"), args)
        check_not_converted(model, args)
        check_text_prompts(args, train_dataset=kwargs.get("train_dataset"), eval_dataset=kwargs.get("eval_dataset"))
        lora = kwargs.get("peft_config") is not None or (not isinstance(model, str) and is_peft_model(model))
        fsdp_version = check_fsdp_supported(args, lora=lora)
        warn_truncated_sampling(args)
        check_fp8_kv_cache(model, args)
        recipe = args.resolved_fp8_recipe
        if args.fp8_training or args.fp8_generation:
            # With FP8 sampling only, no conversion of the learner would name what stays in high precision.
            check_fp8_architecture(model, args, warn=not args.fp8_training)
        if args.fp8_training:
            zero3 = args.deepspeed_plugin is not None and args.deepspeed_plugin.zero_stage == 3
            check_backend_runs_here(recipe, args.device, sharded=zero3 or fsdp_version is not None)
        engine = None
        if args.use_vllm and args.fp8_generation:
            # TRL builds its vLLM engine inside GRPOTrainer.__init__: it builds ours, with TRL's own arguments.
            engine = partial(
                FP8VLLMGeneration,
                recipe=recipe,
                fp8_kv_cache=args.fp8_kv_cache,
                kv_scale_percentile=args.fp8_kv_scale_percentile,
                kv_scale_margin=args.fp8_kv_scale_margin,
                vllm_llm_kwargs=args.vllm_llm_kwargs,
            )
        with _engine_class(engine), reference_converted_before_wrapping(self):
            super().__init__(model, reward_funcs, args=args, **kwargs)
        if args.use_vllm:  # before any forward of the learner (ours and TRL's BF16 engine alike)
            restore_module_call(self.model, self.ref_model)
        self.fp8_backend = "none"
        check_not_quantized(unwrap_peft(self.accelerator.unwrap_model(self.model)), None, args)  # as loaded
        if is_peft_model(self.accelerator.unwrap_model(self.model)):  # what the skeleton could not check
            policy = unwrap_peft(self.accelerator.unwrap_model(self.model))
            check_peft_supported(policy, allow_dropout=not args.fp8_training)
        if args.fp8_save_format == "fp8":  # refused before conversion, rather than when the run ends
            with learner_gather(self.accelerator, self.model) as gather:
                stream_checkpoint_names(unwrap_peft(self.accelerator.unwrap_model(self.model)), recipe, gather=gather)
        if args.fp8_training:
            # Conversion warns about what stays in high precision; those warnings point at the user's line that
            # built the trainer rather than at this file (any other warning keeps its own place).
            caught = []
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    # With PEFT: the frozen base linears in FP8, each LoRA layer on its merged weight in FP8.
                    how = sharding(self)
                    policy = unwrap_peft(self.accelerator.unwrap_model(self.model))
                    policy = convert_to_fp8(policy, recipe, sharded=how is not None, device=training_device(self))
                    convert_lora_layers(policy)
                    ref = None if self.ref_model is None else self.accelerator.unwrap_model(self.ref_model)
                    if ref is not None and getattr(ref, "fp8_recipe", None) is None:  # (wrapped ones: converted)
                        convert_to_fp8(ref, recipe)
                    # Before DeepSpeed's engine or FSDP's units exist (built in `train()`).
                    if how == "zero3":
                        prepare_for_zero3(policy)
                    elif how == "fsdp2":
                        prepare_for_fsdp2(policy)
            finally:  # also when conversion fails: what it warned of before is not lost
                for w in caught:
                    if str(w.message).startswith("trl-fp8:"):
                        warnings.warn(w.message, w.category, stacklevel=2)
                    else:
                        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
            self.fp8_backend = learner_backend(policy, recipe, self.accelerator.device)
            logger.info("trl-fp8: the learner's FP8 linears run on the %r backend", self.fp8_backend)
            warn_emulated_on_gpu(self.fp8_backend, recipe, self.accelerator.device)

        if self.rollout_func is not None and self.vllm_importance_sampling_correction:
            self.rollout_func = _with_sampler_logprobs(self.rollout_func)
        if args.use_vllm:
            return  # vLLM samples: block FP8 (FP8VLLMGeneration) or, with fp8_generation=False, TRL's BF16 engine
        if args.bf16:
            sampler_dtype = torch.bfloat16
        elif args.fp16:
            sampler_dtype = torch.float16
        else:
            sampler_dtype = self.accelerator.unwrap_model(self.model).dtype
        # TRL's sampling-engine slot: GRPOTrainer calls `sync_weights()` and `generate()` on it and, with
        # `use_vllm` set, computes the importance-sampling ratio from the log-probs it returns.
        self.vllm_generation = ReferenceEngine(
            self.model,
            self.accelerator,
            recipe,
            fp8=args.fp8_generation,
            dtype=sampler_dtype,
            eos_token_ids=self.eos_token_ids,
            pad_token_id=self._tokenizer.pad_token_id,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            max_completion_length=self.max_completion_length,
            generation_kwargs=args.generation_kwargs,
            kv_cache=args.fp8_kv_cache,
            kv_scale_percentile=args.fp8_kv_scale_percentile,
            kv_scale_margin=args.fp8_kv_scale_margin,
            cast_lm_head_to_fp32=args.cast_lm_head_to_fp32,
            cache_implementation=args.cache_implementation,
        )
        self.use_vllm = True
        self.vllm_mode = "fp8_reference"  # neither "colocate" nor "server": no vLLM object behind the slot
        self._last_loaded_step = -1

    def train(self, *args, **kwargs):
        # TRL refits the sampler when `global_step` differs from the step it last synced at; a second `train()`
        # restarts `global_step`, and its first generation could then find them equal and sample with the old weights.
        self._last_loaded_step = -1
        self._in_train = True
        try:
            return super().train(*args, **kwargs)
        finally:
            self._in_train = False

    def evaluate(self, *args, **kwargs):
        try:
            return super().evaluate(*args, **kwargs)
        finally:
            # In train(), only the evaluation after the last step: a training log follows any other.
            if not getattr(self, "_in_train", False) or self.state.global_step >= self.state.max_steps:
                self._log_pending_sync()

    def _log_pending_sync(self) -> None:
        # A refit that an evaluation ran after the last training log (the final one in train(), or a standalone
        # evaluate()) has no training log left to carry it: log it on its own, at the current step.
        train = self._metrics["train"]
        keys = [k for k in train if k.startswith(("fp8/sync_", "fp8/kv_calibration_")) and train[k]]
        if keys:
            Trainer.log(self, {k: sum(train[k]) / len(train[k]) for k in keys})  # not GRPOTrainer's: no other metric
            for k in keys:
                del train[k]

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        if not self._loaded_in_original_layout(resume_from_checkpoint, "resume_from_checkpoint", model):
            super()._load_from_checkpoint(resume_from_checkpoint, model)
        self._last_loaded_step = -1  # new weights at the same `global_step`: TRL's refit check would not see them

    def _load_best_model(self) -> None:
        if not self._loaded_in_original_layout(self.state.best_model_checkpoint, "load_best_model_at_end"):
            super()._load_best_model()
        self._last_loaded_step = -1  # the next generation (an evaluation) samples with the best weights too

    def _loaded_in_original_layout(self, checkpoint: str, caller: str, model: nn.Module | None = None) -> bool:
        # A checkpoint save_pretrained wrote in the original key layout (MoE experts, one by one) would be read back
        # by the Trainer's plain load_state_dict, matching none of those keys (see `.checkpoints`).
        target = self.accelerator.unwrap_model(model if model is not None else self.model, keep_torch_compile=False)
        if self.is_deepspeed_enabled or self.is_fsdp_enabled or is_peft_model(target):  # their own keys / adapters
            return False
        return load_converted_checkpoint(target, checkpoint, caller)

    def _save_rng_state(self, output_dir: str) -> None:
        # A checkpoint's per-rank state: the FP8 KV cache's next calibration batch goes beside the RNG states.
        super()._save_rng_state(output_dir)
        batch = getattr(self.vllm_generation, "calibration_batch", None)
        if getattr(self.vllm_generation, "kv_cache", False) and batch is not None:
            save_calibration_batch(batch, calibration_file(output_dir, self.args.world_size, self.args.process_index))

    def _load_optimizer_and_scheduler(self, checkpoint):
        # On resuming, every rank, before anything generates (also `eval_on_start`'s evaluation, which runs before
        # the RNG states are restored), whatever `ignore_data_skip` is; TRL restores its own state here too.
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and getattr(self.vllm_generation, "kv_cache", False):
            path = calibration_file(checkpoint, self.args.world_size, self.args.process_index)
            self.vllm_generation.calibration_batch = load_calibration_batch(path)

    def _first_calibration_batch(self, prompt_ids: list[list[int]]) -> None:
        # The very first KV calibration has no finished batch to run on: rows of the prompts about to be sampled.
        engine = self.vllm_generation
        if getattr(engine, "kv_cache", False) and engine.calibration_batch is None:
            rows, pad_token_id = self.args.fp8_kv_calibration_rows, self._tokenizer.pad_token_id
            engine.calibration_batch = prompts_batch(prompt_ids, rows, pad_token_id)

    def _generate_single_turn(self, prompt_ids, *args, **kwargs):
        # TRL syncs the engine here, with the prompts tokenized as the engine gets them (an environment's `reset()`
        # observation and its tools' schema included).
        self._first_calibration_batch(prompt_ids)
        return super()._generate_single_turn(prompt_ids, *args, **kwargs)

    def _generate_and_score_completions(self, inputs):
        engine = self.vllm_generation
        kv_cache = getattr(engine, "kv_cache", False)
        if kv_cache and self.rollout_func is not None:  # which TRL syncs for before calling it, on the raw prompts
            self._first_calibration_batch(self._tokenize_prompts([x["prompt"] for x in inputs])[0])
        output = super()._generate_and_score_completions(inputs)
        mode = "train" if self.model.training else "eval"
        if kv_cache and mode == "train":  # the next recalibration (after the next optimizer step) runs on this batch
            engine.calibration_batch = rollouts_batch(output, self.args.fp8_kv_calibration_rows)
        # A constant series whose name says which kernels trained this step (te, torch, triton, emulated).
        self._metrics[mode][f"fp8/backend/{self.fp8_backend}"].append(1.0)
        sync = getattr(engine, "last_sync", None)
        if sync is not None:
            # The refit after an optimizer step belongs to training, even when an evaluation's generation ran it.
            engine.last_sync = None
            self._metrics["train"]["fp8/sync_seconds"].append(sync["seconds"])
            self._metrics["train"]["fp8/sync_bytes"].append(sync["bytes"])
            self._metrics["train"]["fp8/sync_bf16_bytes"].append(sync["bf16_bytes"])
            if "kv_calibration_seconds" in sync:
                self._metrics["train"]["fp8/kv_calibration_seconds"].append(sync["kv_calibration_seconds"])
        if self.args.fp8_mismatch_metrics and "sampling_per_token_logps" in output:
            self._log_mismatch(output, mode)
            if self._is_moe and isinstance(engine, ReferenceEngine):  # vLLM's routing is not observable here
                self._log_router_mismatch(output, mode)
        return output


def _by_name(model, reward_funcs, args, more: tuple, kwargs: dict) -> dict:
    """`GRPOTrainer.__init__`'s arguments after `args`, all by name, bound to its own signature (a wrong or doubled
    one raises Python's own `TypeError`)."""
    bound = inspect.signature(GRPOTrainer.__init__).bind(None, model, reward_funcs, args, *more, **kwargs).arguments
    return dict(list(bound.items())[4:])


def _with_sampler_logprobs(rollout_func):
    """`rollout_func`, refusing an output without the sampler's log-probs by name: the sampler's log-probs are what
    the importance-sampling correction compares the learner's with (TRL would fail on them with a bare TypeError)."""

    @wraps(rollout_func)
    def rollout(prompts, trainer):
        output = rollout_func(prompts, trainer)
        logprobs = output.get("logprobs", ()) if isinstance(output, dict) else ()
        if logprobs is None or any(row is None for row in logprobs):
            raise ValueError(
                "rollout_func returned no 'logprobs': with vllm_importance_sampling_correction=True the learner's "
                "log-probs are compared with the sampler's, token by token, to correct their mismatch. Return those "
                "of the engine that sampled (trainer.vllm_generation.generate(...) returns them), or set "
                "vllm_importance_sampling_correction=False."
            )
        return output

    return rollout


@contextmanager
def _engine_class(engine_class):
    """Makes GRPOTrainer.__init__ build `engine_class` where it builds TRL's `VLLMGeneration` (if not None)."""
    if engine_class is None:
        yield
        return
    original = trl_grpo.VLLMGeneration
    trl_grpo.VLLMGeneration = engine_class
    try:
        yield
    finally:
        trl_grpo.VLLMGeneration = original


def learner_backend(policy, recipe, device: torch.device) -> str:
    """Which kernels the converted learner runs on: `none` if nothing was converted, `te` if its linears are
    TransformerEngine's, else the GEMM backend `recipe.backend` resolves to on `device`, the one it computes on (the
    accelerator's: under ZeRO-3 or FSDP2 its parameters may still be on the CPU here, or stay there when offloaded)."""
    if not fp8_modules(policy):  # the recipe converted nothing (dims off the block grid, exclusions)
        return "none"
    if any(is_te_linear(m) for m in policy.modules()):
        return "te"
    # As FP8Linear resolves it: with "te", the linears TE does not take (LoRA's base layers, other weight blocks) run
    # on "auto", which takes the oracle for weight blocks other than 128x128.
    auto_other_block = recipe.backend in ("auto", "te") and list(recipe.weight_block_size) != [128, 128]
    name = "emulated" if auto_other_block else "auto" if recipe.backend == "te" else recipe.backend
    return resolve_backend(name, device).name
