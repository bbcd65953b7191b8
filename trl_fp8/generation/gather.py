"""Whole weights from a sharded learner, for the stream (`trl_fp8.quant.export`'s `gather`): DeepSpeed ZeRO-3 through
TRL's `DistributedBackend.gather_params`, FSDP2 through its units' own `unshard()`, a module at a time."""

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from torch import nn
from torch.distributed.tensor import DTensor
from trl.distributed import DistributedBackend


class FSDP2Gather:
    """A `gather` for FSDP2: the units (`fully_shard`ed modules) owning the parameters asked for are unsharded FSDP's
    own way (`FSDPModule.unshard()`), which swaps whole tensors into their modules, cast to the mixed-precision
    policy's `param_dtype` as for a forward, so the stream quantizes the very bits the learner's forward quantizes.

    A unit stays whole until a parameter of another unit is asked for, or `close()`: the stream reads a decoder
    layer's linears one after the other, which then all-gather the layer once, not once per linear; one unit is whole
    at a time, as during a forward. Every rank must read the same modules in the same order (the gathers are
    collective), as for ZeRO-3.

    Args:
        model (`nn.Module`):
            The model FSDP wrapped, outermost (with PEFT, the `PeftModel`: its outermost unit owns the embeddings).
            Its units are resharded first (FSDP keeps some whole after a forward: the outermost one, and
            accelerate's unit of the final norm and the head), so that every parameter is found by its shard.
            Parameters of no unit (the model not wrapped yet) are read as they are.
    """

    def __init__(self, model: nn.Module):
        from torch.distributed.fsdp import FSDPModule

        self._owner: dict[int, nn.Module] = {}  # parameter (its shard, or its whole tensor once seen) -> its unit
        self._modules: dict[int, list[nn.Module]] = {}  # unit -> the modules whose own parameters it holds
        self._whole: list[nn.Module] = []
        units: dict[int, nn.Module] = {}  # one per FSDP state: `fully_shard([norm, lm_head])` makes one of two modules
        for module in model.modules():
            if isinstance(module, FSDPModule):
                state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else module
                units.setdefault(id(state), module).reshard()  # local: frees the whole copy, if any
        stack: list[tuple[nn.Module, nn.Module | None]] = [(model, None)]
        while stack:
            module, unit = stack.pop()
            if isinstance(module, FSDPModule):
                state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else module
                unit = units[id(state)]
            if unit is not None:
                self._modules.setdefault(id(unit), []).append(module)
                for p in module.parameters(recurse=False):
                    self._owner.setdefault(id(p), unit)
            stack.extend((child, unit) for child in module.children())

    @contextmanager
    def __call__(self, params: Iterable[nn.Parameter]) -> Iterator[None]:
        # A parameter of no known unit is whole already and keeps whatever is whole as it is.
        units = list({id(u): u for p in params if (u := self._owner.get(id(p))) is not None}.values())
        if units:
            for unit in self._whole:
                if all(unit is not u for u in units):
                    unit.reshard()
            self._whole = units
        for unit in units:
            modules = self._modules[id(unit)]
            # Looked at, not remembered: FSDP may have resharded it meanwhile (a `state_dict()` reshards every unit).
            if any(isinstance(p, DTensor) for m in modules for p in m.parameters(recurse=False)):
                unit.unshard()
                # The whole tensors now in the modules are the unit's too (FSDP2 keeps them from one unshard to the
                # next): a module read again while its unit is whole names them.
                for module in modules:
                    for p in module.parameters(recurse=False):
                        self._owner[id(p)] = unit
        yield

    def close(self) -> None:
        """Reshards what is still whole."""
        for unit in self._whole:
            unit.reshard()
        self._whole = []


@contextmanager
def activation_wrappers_set_aside(model: nn.Module) -> Iterator[None]:
    """While this context lasts, `model`'s activation-checkpoint wrappers (torch's `checkpoint_wrapper`, which
    accelerate puts around each decoder layer for FSDP's `activation_checkpointing`) are replaced by the modules they
    wrap, so that names read as the checkpoint's (`...layers.0.self_attn...`, not
    `...layers.0._checkpoint_wrapped_module.self_attn...`). Nothing runs meanwhile; they are put back after."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper

    swapped = []
    try:
        for name, module in list(model.named_modules()):
            # The outermost wrappers of submodules (a wrapped `model` itself has no parent to swap it in).
            if name and isinstance(module, ActivationWrapper) and "_checkpoint_wrapped_module" not in name:
                inner = module
                while isinstance(inner, ActivationWrapper):
                    inner = inner._checkpoint_wrapped_module
                parent_name, _, child = name.rpartition(".")
                parent = model.get_submodule(parent_name)
                setattr(parent, child, inner)
                swapped.append((parent, child, module))
        yield
    finally:
        for parent, child, module in reversed(swapped):
            setattr(parent, child, module)


@contextmanager
def learner_gather(accelerator, model: nn.Module) -> Iterator:
    """The `gather` that reads the learner's whole weights while this context lasts: TRL's for DeepSpeed ZeRO-3, an
    `FSDP2Gather` of `model` (the trainer's model, outermost) for FSDP2, else `None` (the weights are whole).
    Meanwhile `model` reads in its checkpoint's names (`activation_wrappers_set_aside`)."""
    dist = DistributedBackend(accelerator)
    if dist.is_zero3:
        with activation_wrappers_set_aside(model):
            yield dist.gather_params
    elif dist.fsdp_version == 2:
        # Its units are found with the wrappers in place: accelerate >= 1.16 shards a checkpointed layer's wrapper
        # (1.15, the layer inside it), and the model holds no wrapper while they are set aside.
        gather = FSDP2Gather(model)
        try:
            with activation_wrappers_set_aside(model):
                yield gather
        finally:
            gather.close()
    else:
        with activation_wrappers_set_aside(model):
            yield None
