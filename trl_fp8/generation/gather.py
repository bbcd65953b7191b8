"""Whole weights from a sharded learner, for the stream (`trl_fp8.quant.export`'s `gather`): DeepSpeed ZeRO-3 through
TRL's `DistributedBackend.gather_params`, FSDP2 through its units' own `unshard()`, a module at a time."""

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from torch import nn
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
            Parameters of no unit (the model not wrapped yet) are read as they are.
    """

    def __init__(self, model: nn.Module):
        from torch.distributed.fsdp import FSDPModule

        self._owner: dict[int, nn.Module] = {}  # parameter (sharded, or whole once unsharded here) -> its unit
        self._modules: dict[int, list[nn.Module]] = {}  # unit -> the modules whose own parameters it holds
        self._whole: list[nn.Module] = []
        stack: list[tuple[nn.Module, nn.Module | None]] = [(model, None)]
        while stack:
            module, unit = stack.pop()
            unit = module if isinstance(module, FSDPModule) else unit
            if unit is not None:
                self._modules.setdefault(id(unit), []).append(module)
                for p in module.parameters(recurse=False):
                    self._owner.setdefault(id(p), unit)
            stack.extend((child, unit) for child in module.children())

    @contextmanager
    def __call__(self, params: Iterable[nn.Parameter]) -> Iterator[None]:
        # A parameter of no known unit is whole already (FSDP keeps its outermost unit whole after a forward without
        # grad) and keeps whatever is whole as it is.
        units = list({id(u): u for p in params if (u := self._owner.get(id(p))) is not None}.values())
        if units:
            for unit in self._whole:
                if all(unit is not u for u in units):
                    unit.reshard()
            self._whole = [u for u in self._whole if any(u is unit for unit in units)]
        for unit in units:
            if all(unit is not u for u in self._whole):
                unit.unshard()
                self._whole.append(unit)
                # The whole tensors now in the modules are the unit's too (FSDP2 keeps them from one unshard to the
                # next): a module read again while its unit is whole names them.
                for module in self._modules[id(unit)]:
                    for p in module.parameters(recurse=False):
                        self._owner[id(p)] = unit
        yield

    def close(self) -> None:
        """Reshards what is still whole."""
        for unit in self._whole:
            unit.reshard()
        self._whole = []


@contextmanager
def learner_gather(accelerator, model: nn.Module) -> Iterator:
    """The `gather` that reads the learner's whole weights while this context lasts: TRL's for DeepSpeed ZeRO-3, an
    `FSDP2Gather` of `model` (the trainer's model, outermost) for FSDP2, else `None` (the weights are whole)."""
    dist = DistributedBackend(accelerator)
    if dist.is_zero3:
        yield dist.gather_params
    elif dist.fsdp_version == 2:
        gather = FSDP2Gather(model)
        try:
            yield gather
        finally:
            gather.close()
    else:
        yield None
