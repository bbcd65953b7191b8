"""Resuming from a Trainer checkpoint whose keys are not the model's own.

transformers 5 saves a model in its architecture's original key layout: `save_pretrained` reverts the weight
conversions `from_pretrained` applied, so a Qwen3-MoE's fused `mlp.experts.gate_up_proj` goes to disk as per-expert
`mlp.experts.{e}.gate_proj.weight` and `up_proj.weight`. `Trainer._load_from_checkpoint` (transformers 5.24) reads a
checkpoint back with a plain `load_state_dict(strict=False)`, which matches none of those keys. It only warns, and
training goes on with the experts as they were before the resume, in plain TRL as here.

Loading the checkpoint through `from_pretrained`, which applies the conversions, and copying its state in, restores
every weight. DeepSpeed's and FSDP's checkpoints hold the module's own state dict and are not affected."""

import json
import logging
import os

import torch
from safetensors import safe_open
from torch import nn
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME


logger = logging.getLogger(__name__)


def checkpoint_keys(checkpoint: str) -> set[str] | None:
    """The tensor names of a checkpoint folder's safetensors weights (one file or an index), or `None` if it has
    neither."""
    single, index = os.path.join(checkpoint, SAFE_WEIGHTS_NAME), os.path.join(checkpoint, SAFE_WEIGHTS_INDEX_NAME)
    if os.path.isfile(single):
        with safe_open(single, "pt") as f:
            return set(f.keys())
    if os.path.isfile(index):
        with open(index) as f:
            return set(json.load(f)["weight_map"])
    return None


def load_converted_checkpoint(model: nn.Module, checkpoint: str, caller: str = "resume_from_checkpoint") -> bool:
    """Loads `checkpoint` into `model` through `from_pretrained` (its weight conversions applied) when the checkpoint
    holds keys the model does not have; returns whether it did (`False`: a plain `load_state_dict` reads it whole).

    Every tensor the model saves must come from the checkpoint, else it raises naming them (`caller`, the Trainer
    argument that asked, in the message) before the model is touched: `from_pretrained` would fill a missing one
    with a fresh initialization, which a resume must not copy in. The weights are read in their own dtypes (in
    fp32 where the model mixes dtypes, e.g. an fp32 lm_head beside bf16 layers: exact for both). Holds a second copy
    of the weights on the CPU meanwhile, on every rank."""
    keys = checkpoint_keys(checkpoint)
    own = model.state_dict()
    if keys is None or keys <= set(own):  # (tied weights are saved once: fewer keys, never others)
        return False
    quantized = sorted(k for k in keys if k.endswith("_scale_inv"))
    if quantized:  # from_pretrained would dequantize it on a CPU: a resume on quantized weights, without a word
        raise ValueError(
            f"{caller}: {checkpoint} holds an FP8 checkpoint ({quantized[0]}, ...: the final save with "
            "fp8_save_format='fp8'), not the master weights training goes on from; resume from a checkpoint-N "
            "folder, which keeps them"
        )
    logger.info(
        "trl-fp8: %s is saved in %s's original key layout (%d tensors the model does not name, e.g. %s); loading it "
        "through from_pretrained, which converts them",
        checkpoint,
        type(model).__name__,
        len(keys - set(own)),
        sorted(keys - set(own))[0],
    )
    dtypes = {t.dtype for t in own.values() if t.is_floating_point()}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    loaded, info = type(model).from_pretrained(checkpoint, dtype=dtype, device_map=None, output_loading_info=True)
    not_saved = set(getattr(model, "_keys_to_ignore_on_save", None) or [])  # they keep the model's own values
    mismatched = {k if isinstance(k, str) else k[0] for k in info["mismatched_keys"]}  # (key, shapes...) tuples
    missing = sorted((set(info["missing_keys"]) | mismatched) - not_saved)
    state = {n: t for n, t in loaded.state_dict().items() if n not in not_saved}
    missing += sorted(set(own) - set(state) - not_saved)
    if missing or set(state) - set(own):
        raise RuntimeError(
            f"{caller}: {checkpoint} does not hold every tensor of {type(model).__name__} once converted: missing "
            f"{missing[:5]}, unexpected {sorted(set(state) - set(own))[:5]}"
        )
    model.load_state_dict(state, strict=not not_saved)
    return True
