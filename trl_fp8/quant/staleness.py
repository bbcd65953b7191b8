"""What tells a cache of FP8 weights (or a sampler's last sync) that the weights it was made from changed.

Version counters alone do not: fused optimizers (transformers' default `adamw_torch_fused`) update parameters without
bumping them, and writes through `.data` bypass them. Every optimizer step, and every `mark_weights_changed()`, bumps
one process-wide epoch instead. Nor do `id()` and storage addresses: a Parameter put in place of a freed one may
take both, and its version, so each tensor object also gets a serial number that is never reused.
"""

import itertools
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook


_optimizer_steps = 0


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


register_optimizer_step_post_hook(_count_optimizer_step)


def weights_epoch() -> int:
    """How many optimizer steps (of any optimizer) have run in this process, plus `mark_weights_changed()` calls."""
    return _optimizer_steps


def mark_weights_changed() -> None:
    """Tells every FP8 module that weights changed outside an optimizer step through writes that bypass version
    counters (`param.data.copy_(...)`, `param.data = ...`): their cached FP8 weights are then re-made."""
    global _optimizer_steps
    _optimizer_steps += 1


_serials: dict[int, int] = {}
_next_serial = itertools.count()


def serial(t: torch.Tensor) -> int:
    """A number for the tensor object `t` that no other object gets in this process, unlike `id(t)` once `t` is
    gone (its entry leaves with it, before the id can be reused)."""
    key = id(t)
    number = _serials.get(key)
    if number is None:
        number = _serials[key] = next(_next_serial)
        weakref.finalize(t, _serials.pop, key, None)
    return number
