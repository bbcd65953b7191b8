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


def load_converted_checkpoint(model: nn.Module, checkpoint: str) -> bool:
    """Loads `checkpoint` into `model` through `from_pretrained` (its weight conversions applied) when the checkpoint
    holds keys the model does not have; returns whether it did (`False`: a plain `load_state_dict` reads it whole).

    Holds a second copy of the weights on the CPU meanwhile. Raises if the converted checkpoint still misses or adds
    a tensor of the model, naming them: a resume must not go on with weights it did not restore."""
    keys = checkpoint_keys(checkpoint)
    own = model.state_dict()
    if keys is None or keys <= set(own):  # (tied weights are saved once: fewer keys, never others)
        return False
    logger.info(
        "trl-fp8: %s is saved in %s's original key layout (%d tensors the model does not name, e.g. %s); loading it "
        "through from_pretrained, which converts them",
        checkpoint,
        type(model).__name__,
        len(keys - set(own)),
        sorted(keys - set(own))[0],
    )
    loaded = type(model).from_pretrained(checkpoint, dtype="auto", device_map=None)
    state = loaded.state_dict()
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise RuntimeError(
            f"resume_from_checkpoint: {checkpoint} does not hold {type(model).__name__}'s tensors once converted "
            f"(missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    model.load_state_dict(state)
    return True
