"""What colocating vLLM with the learner in one process changes in the learner's classes, undone for the learner.

vLLM serves the architectures it has no class of its own for (OLMo 2, SmolLM3, ... in vLLM 0.31; every architecture
with `vllm_model_impl="transformers"`) through its Transformers backend, which makes the transformers decoder class
it runs compilable *in place*: `support_torch_compile` adds a base class to, e.g., transformers' `Olmo2Model` and
replaces its `__init__` and `__call__`. The policy and the reference model, built before the engine, are instances of
that very class: the new `__call__` reads `do_not_compile`, which only the new `__init__` sets, so their first forward
raises `AttributeError: 'Olmo2Model' object has no attribute 'do_not_compile'` (nothing in the patch is FP8's: so
with TRL's BF16 engine too).
vLLM's instance needs the patched class; the learner's instances are moved to a subclass with `nn.Module.__call__`
back (hooks included), which runs them exactly as before the engine existed.
"""

import logging

from torch import nn


logger = logging.getLogger(__name__)
_UNPATCHED: dict[type, type] = {}


def _patched_by_vllm(cls: type) -> bool:
    call = cls.__call__
    return call is not nn.Module.__call__ and getattr(call, "__module__", "").startswith("vllm.")


def restore_module_call(*models: nn.Module | None) -> list[str]:
    """Gives every module of `models` whose class vLLM patched in place `nn.Module.__call__` back; returns the
    names of the classes it found patched (none when vLLM serves the architecture with its own class)."""
    found = []
    for model in models:
        if model is None:
            continue
        for module in model.modules():
            cls = type(module)
            if not _patched_by_vllm(cls):
                continue
            if cls not in _UNPATCHED:
                attrs = {
                    "__call__": nn.Module.__call__,
                    "__module__": cls.__module__,
                    "__qualname__": cls.__qualname__,
                }
                _UNPATCHED[cls] = type(cls.__name__, (cls,), attrs)
            if cls.__name__ not in found:
                found.append(cls.__name__)
            module.__class__ = _UNPATCHED[cls]
    if found:
        logger.info("trl-fp8: vLLM's Transformers backend patched %s in place; the learner runs them unpatched", found)
    return found
