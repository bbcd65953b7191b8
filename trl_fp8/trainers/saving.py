"""What `FP8GRPOTrainer` writes: the FP8 checkpoint (`fp8_save_format="fp8"`), what `push_to_hub` uploads, the
recipe beside the weights, and the model card's FP8 section."""

import json
import logging
import os
from contextlib import contextmanager

import torch
from transformers.trainer import TRAINING_ARGS_NAME

from ..generation.gather import learner_gather
from ..quant.adapters import unwrap_peft
from ..quant.fp8_checkpoint import REPLACED_FILES, save_fp8_checkpoint
from .sharded import sharding


logger = logging.getLogger(__name__)


class FP8Saving:
    """`Trainer`'s saving hooks for an FP8 GRPO run (a mixin placed before `GRPOTrainer`):

    - `save_model`: with `fp8_save_format="fp8"`, writes the block-FP8 checkpoint of the export stream (with the FP8
      KV cache's scales); always writes the recipe (`fp8_recipe.json`) beside the weights.
    - `push_to_hub`: with `fp8_save_format="fp8"` uploads the FP8 checkpoint, deleting what it replaces.
    - `create_model_card`: TRL's card, plus a section with the recipe, the FP8 settings and the run's mismatch.
    """

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        path = os.path.join(self.args.output_dir, "README.md")
        if not self.is_world_process_zero() or not os.path.exists(path):
            return
        args = self.args
        lines = [
            "",
            "## FP8 training",
            "",
            "Trained with trl-fp8's `FP8GRPOTrainer`: "
            f"FP8 training `{args.fp8_training}` (backend `{self.fp8_backend}`), FP8 generation "
            f"`{args.fp8_generation}` ({'colocated vLLM' if args.use_vllm else 'reference engine'}), "
            "importance sampling "
            f"`{args.vllm_importance_sampling_mode}` (cap {args.vllm_importance_sampling_clip_max}) "
            f"{'on' if args.vllm_importance_sampling_correction else 'off'}.",
            "",
            "Recipe (`fp8_recipe.json`):",
            "",
            "```json",
            json.dumps(args.resolved_fp8_recipe.to_dict(), indent=2, sort_keys=True),
            "```",
        ]
        metrics = ("sampling/token_mult_prob_error", "sampling/gen_kl", "sampling/is_oob_ratio", "fp8/router_mismatch")
        rows = []
        for key in metrics:
            values = [log[key] for log in self.state.log_history if key in log]
            if values:
                rows.append(f"| `{key}` | {sum(values) / len(values):.6g} | {values[-1]:.6g} |")
        if rows:
            lines += [
                "",
                "Learner/sampler mismatch over the run:",
                "",
                "| metric | mean | last |",
                "| --- | --- | --- |",
            ]
            lines += rows
        with open(path, "a") as f:
            f.write("\n".join(lines) + "\n")

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        # Checkpoints written during training keep the master weights: resuming from FP8 would lose them. The save
        # inside `push_to_hub` is internal too, but it writes what is uploaded.
        final = not _internal_call or getattr(self, "_saving_for_push", False)
        if self.args.fp8_save_format != "fp8" or not final:
            if self.args.should_save:  # (Trainer's own push reads the folder after an internal save)
                self.args.resolved_fp8_recipe.save_pretrained(output_dir)
            return super().save_model(output_dir, _internal_call=_internal_call)
        # The FP8 KV cache's scales for these weights, for vLLM serving the checkpoint with an FP8 KV cache (measured
        # on every rank: the ranks agree on one max).
        kv_scales = self.vllm_generation.checkpoint_kv_scales() if self.args.fp8_kv_cache else []
        if self.args.fp8_kv_cache and not kv_scales:
            logger.warning(
                "trl-fp8: the FP8 checkpoint in %s carries no FP8 KV-cache scales (none measured yet: no step has "
                "run); vLLM serving it with kv_cache_dtype='fp8' takes 1.0",
                output_dir,
            )
        if self.args.should_save or sharding(self) is not None:  # gathers are collective: every rank reads
            policy = unwrap_peft(self.accelerator.unwrap_model(self.model))  # adapters merged, in FP8
            recipe, write = self.args.resolved_fp8_recipe, self.args.should_save
            with learner_gather(self.accelerator, self.model) as gather:
                save_fp8_checkpoint(policy, output_dir, recipe, gather=gather, write=write, kv_scales=kv_scales)
        if self.args.should_save:
            # Once the weights it describes are in: a refused save leaves the folder's earlier recipe as it was.
            self.args.resolved_fp8_recipe.save_pretrained(output_dir)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))  # as Trainer._save does
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def push_to_hub(self, *args, **kwargs):
        # Trainer.push_to_hub writes `output_dir` with `save_model(_internal_call=True)`, then uploads it: with
        # fp8_save_format="fp8" that folder must hold the FP8 checkpoint, not the master weights.
        self._saving_for_push = True
        try:
            if self.args.fp8_save_format != "fp8":
                return super().push_to_hub(*args, **kwargs)
            with _uploads_deleting(REPLACED_FILES):
                return super().push_to_hub(*args, **kwargs)
        finally:
            self._saving_for_push = False


@contextmanager
def _uploads_deleting(patterns: tuple[str, ...]):
    """Makes Trainer's uploads delete the repository's files matching `patterns` in the same commit: the pushes during
    training (`hub_strategy="every_save"`) uploaded the checkpoints' master weights or adapters, which the final FP8
    checkpoint replaces (the upload adds files, it never removes any by itself)."""
    import transformers.trainer as hf_trainer

    original = hf_trainer.hf_api

    class _Api:
        def __init__(self):
            self._api = original()

        def __getattr__(self, name):
            return getattr(self._api, name)

        def upload_folder(self, *args, **kwargs):
            return self._api.upload_folder(*args, delete_patterns=list(patterns), **kwargs)

    hf_trainer.hf_api = _Api
    try:
        yield
    finally:
        hf_trainer.hf_api = original
