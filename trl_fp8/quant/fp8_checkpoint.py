"""A block-FP8 checkpoint of the export stream (`trl_fp8.quant.export`), written whole or not at all.

Every check runs before the first byte is written (the recipe, the names, non-finite tensors, the KV-cache scales),
and the files are written into a staging folder inside the target and moved in only once all of them exist, the ones
they replace set aside until then: a save that fails, however late, leaves the folder's earlier checkpoint as it
was (short of the process dying between two renames: the next save then names the folder they wait in). A save
killed before its renames leaves its staging folder, which the next save into the folder removes.
"""

import contextlib
import copy
import dataclasses
import fnmatch
import json
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Sequence

import torch
from safetensors.torch import save_file
from torch import nn

from .checkpoint_names import CheckpointNames, checkpoint_module_names
from .export import Gather, high_precision_modules, iter_fp8_state, refuse_nonfinite
from .kv_cache import KV_SCALE_SUFFIXES


# A save's folders inside its target: the new files until all exist, and the files they replace until they are in.
STAGING_PREFIX, ASIDE_PREFIX = ".trl-fp8-save-", ".trl-fp8-old-"

_EXPERT_LINEAR_RE = re.compile(r"^(.*\.experts)\.\d+\.(?:gate|up|down)_proj$")

# The files of a model folder that a block-FP8 checkpoint replaces: another save's weights (sharded, or `.bin`) or a
# PEFT adapter. Left beside `model.safetensors`, transformers would load the adapter on top of the merged FP8 weights
# (or the adapter's base model instead of them) and vLLM would read the shards an index names.
REPLACED_FILES = (
    "adapter_config.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
    "model.safetensors.index.json",
    "model-*-of-*.safetensors",
    "pytorch_model*.bin",
    "pytorch_model.bin.index.json",
)


def _move_in(staging: str, save_directory: str, patterns: tuple[str, ...]) -> None:
    """Moves the staged files into `save_directory`. The files they overwrite, and those matching `patterns` (which
    loaders would take instead), first go into a folder beside them, and come back if a move fails: renames only,
    so the folder holds its earlier checkpoint or the new one, never a mix (short of a crash between two renames)."""
    new = sorted(os.listdir(staging))
    replaced = sorted(
        name
        for name in os.listdir(save_directory)
        if os.path.isfile(os.path.join(save_directory, name))
        and any(fnmatch.fnmatch(name, pattern) for pattern in patterns)
    )
    old = sorted(set(replaced) | {n for n in new if os.path.isfile(os.path.join(save_directory, n))})
    aside = tempfile.mkdtemp(prefix=ASIDE_PREFIX, dir=save_directory)
    moved_old, moved_new = [], []
    try:
        for name in old:
            os.replace(os.path.join(save_directory, name), os.path.join(aside, name))
            moved_old.append(name)
        for name in new:
            os.replace(os.path.join(staging, name), os.path.join(save_directory, name))
            moved_new.append(name)
    except BaseException:
        for name in moved_new:
            os.replace(os.path.join(save_directory, name), os.path.join(staging, name))
        for name in moved_old:
            os.replace(os.path.join(aside, name), os.path.join(save_directory, name))
        os.rmdir(aside)
        raise
    shutil.rmtree(aside)
    if replaced:  # once they are gone: a failed save restores them
        warnings.warn(
            f"trl-fp8: {save_directory} held {', '.join(replaced)} from an earlier save (other weights, a PEFT "
            "adapter, another model's generation config); removed, as the FP8 checkpoint written there replaces them",
            stacklevel=3,
        )


def _missing_folders(path: str) -> list[str]:
    """The folders `os.makedirs(path)` would create, innermost first: a failed save removes them again."""
    missing, path = [], os.path.abspath(path)
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def _remove_dead_staging(save_directory: str) -> None:
    """Removes the staging folders of saves into `save_directory` that never finished (a killed process): partial
    files that `upload_folder` would push with the checkpoint. (A `.trl-fp8-old-*` folder left by a crash between
    two renames holds an earlier checkpoint's files: it is named, never removed.)"""
    for name in sorted(os.listdir(save_directory)):
        path = os.path.join(save_directory, name)
        if name.startswith(STAGING_PREFIX) and os.path.isdir(path):
            shutil.rmtree(path)
            warnings.warn(f"trl-fp8: removed {path}, the unfinished files of an earlier save", stacklevel=3)
        elif name.startswith(ASIDE_PREFIX) and os.path.isdir(path):
            warnings.warn(
                f"trl-fp8: {path} holds files an earlier save set aside and did not restore (the process ended "
                "between two renames): move back what you need, then remove it",
                stacklevel=3,
            )


def _write_shards(tensors: dict[str, torch.Tensor], directory: str, max_shard_size: int | str) -> bool:
    """`model.safetensors`, or shards of at most `max_shard_size` and their index, as `save_pretrained` names them (the
    Hub takes no file above 50 GB); one shard at a time in CPU memory. Returns whether it wrote shards."""
    from huggingface_hub import split_torch_state_dict_into_shards

    split = split_torch_state_dict_into_shards(tensors, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        # Copies: sibling linears' FP8 weights are row views of one stacked tensor, which safetensors (and so
        # huggingface_hub's `save_torch_state_dict`) refuses; one shard's at a time.
        shard = {n: tensors[n].detach().to("cpu", copy=True).contiguous() for n in names}
        save_file(shard, os.path.join(directory, filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    return split.is_sharded


def _check_kv_scales(kv_scales: list[tuple[str, torch.Tensor]], stream: list[tuple[str, torch.Tensor]]) -> None:
    names = {n for n, _ in stream}
    for name, t in kv_scales:
        if not name.endswith(KV_SCALE_SUFFIXES) or t.numel() != 1:
            raise ValueError(
                f"kv_scales: {name} ({tuple(t.shape)}) is not one Q/K/V scale named as vLLM loads them "
                "(`model.layers.{i}.self_attn.k_scale`, `v_scale`, `q_scale`); nothing was written"
            )
        if name in names:
            raise ValueError(f"kv_scales: {name} is already in the checkpoint (twice); nothing was written")
        names.add(name)


def _same_weights(a, b) -> bool:
    """Whether two recipes quantize the same weights the same way (the kernels that run them aside)."""
    return dataclasses.replace(a, backend="auto", fuse_siblings=True) == dataclasses.replace(
        b, backend="auto", fuse_siblings=True
    )


def save_fp8_checkpoint(
    model: nn.Module,
    save_directory: str,
    recipe,
    gather: Gather | None = None,
    write: bool = True,
    max_shard_size: int | str = "50GB",
    kv_scales: Sequence[tuple[str, torch.Tensor]] = (),
) -> list[str]:
    """Writes the stream as a block-FP8 checkpoint that vLLM serves and transformers loads: `model.safetensors` (or
    shards of at most `max_shard_size`, transformers' default, and their index) under the names `save_pretrained`
    gives (`trl_fp8.quant.checkpoint_names`: experts one by one, as Hub checkpoints store them) plus `config.json`
    with the recipe's `quantization_config` (what stays in high precision listed in `modules_to_not_convert`, in
    transformers' module names, and, where the checkpoint's differ, in `ignored_layers` for vLLM) and the model's
    `generation_config.json`; the folder's files that it replaces (`REPLACED_FILES`: an adapter, another save's
    weights; an earlier `generation_config.json` where the model has none) are removed, once the new ones are
    written. `recipe`: an `FP8Recipe` or anything `FP8Recipe.from_any`
    takes. `gather` as in `iter_fp8_state`; `write=False` reads the stream and writes nothing (ZeRO-3's gathers are
    collective: the ranks that do not write read it too). `kv_scales`: an FP8 KV cache's Q/K/V scales as the sync
    stream names them (`model.layers.{i}.self_attn.k_scale`), saved beside the weights for vLLM's
    `kv_cache_dtype="fp8"` (transformers reports them as unexpected keys and loads the rest). Returns the checkpoint
    names of the FP8 weights."""
    from ..recipe import FP8Recipe  # the recipe module imports trl_fp8.quant

    recipe = FP8Recipe.from_any(recipe)
    converted = getattr(model, "fp8_recipe", None) is not None
    if converted and not _same_weights(model.fp8_recipe, recipe):
        # The weights were quantized with the model's recipe: a config naming another would misdescribe them.
        raise ValueError(f"the model was converted with {model.fp8_recipe}, not with the recipe given, {recipe}")
    pairs, kv_scales = list(iter_fp8_state(model, None if converted else recipe, gather)), list(kv_scales)
    _check_kv_scales(kv_scales, pairs)
    pairs += kv_scales
    refuse_nonfinite(pairs, "nothing was written")
    tensors = dict(CheckpointNames(model, [(n, t.shape, t.dtype) for n, t in pairs])(pairs))
    saved = [n.removesuffix("_scale_inv") for n in tensors if n.endswith("_scale_inv")]
    if not write:
        return saved
    fp8_modules = {n.rsplit(".", 1)[0] for n, t in pairs if t.dtype == torch.float8_e4m3fn}
    fp8_modules |= {m.group(1) for n in fp8_modules if (m := _EXPERT_LINEAR_RE.match(n))}
    kept = high_precision_modules(model, fp8_modules)
    config = copy.deepcopy(model.config)
    config.quantization_config = recipe.to_quantization_config(modules_to_not_convert=kept)
    if (checkpoint_kept := checkpoint_module_names(model, kept)) != kept:
        config.quantization_config["ignored_layers"] = checkpoint_kept
    created = _missing_folders(save_directory)
    os.makedirs(save_directory, exist_ok=True)
    _remove_dead_staging(save_directory)
    staging = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=save_directory)
    try:
        sharded = _write_shards(tensors, staging, max_shard_size)
        config.save_pretrained(staging)
        # vLLM and `generate()` read their sampling defaults and EOS ids from it, as from any transformers checkpoint;
        # without one, an earlier save's would stand for this model's.
        has_generation_config = getattr(model, "generation_config", None) is not None
        if has_generation_config:
            model.generation_config.save_pretrained(staging)
        # Complete: the earlier files that loaders would take instead go, and the new ones move in.
        replaced = REPLACED_FILES + (("model.safetensors",) if sharded else ())
        _move_in(staging, save_directory, replaced + (() if has_generation_config else ("generation_config.json",)))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for folder in created:  # innermost first; only if nothing else was written there meanwhile
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        raise
    os.rmdir(staging)
    return saved
