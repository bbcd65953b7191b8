"""Glue for sharded parameters (DeepSpeed ZeRO-3, FSDP2): FP8 modules that read other modules' weights, and the
reference model converted before DeepSpeed or FSDP wraps it.

ZeRO-3 keeps each parameter sharded and gathers a module's own parameters only while that module runs (hooks before
its forward and its backward); FSDP2 gathers a unit's (a decoder layer's) the same way. Two kinds of FP8 module read
parameters of other modules: sibling linears (`trl_fp8.quant.siblings`: q_proj runs the stacked GEMM of q, k and v)
and FP8 LoRA layers (`trl_fp8.quant.lora`: the base layer's weight merged with the adapters'). Siblings run alone on
sharded parameters (one GEMM each, as without `fuse_siblings`); under ZeRO-3 each FP8 LoRA layer becomes a DeepSpeed
"leaf" (`deepspeed.utils.set_z3_leaf_module`, made for MoE blocks), gathered with everything beneath it (FSDP2's
unit already holds the base layer and its adapters). Both must happen before DeepSpeed builds its engine, or FSDP
its units, which register the hooks.
"""

import warnings
from contextlib import contextmanager

import torch
import trl.trainer.grpo_trainer as trl_grpo
from torch import nn

from ..quant.convert import convert_to_fp8, mark_sharded
from ..quant.lora import FP8LoraLinear
from ..quant.siblings import ungroup_siblings


def prepare_for_zero3(model: nn.Module) -> list[str]:
    """Ungroups `model`'s sibling linears and marks its FP8 LoRA layers as DeepSpeed leaves; returns their names."""
    from deepspeed.utils import set_z3_leaf_module

    # Grouped siblings would need their parent as a leaf: tried so, a Qwen3-MoE's backward failed (o_proj's weight
    # released before autograd accumulated its gradient); alone, each linear needs only its own weight.
    ungroup_siblings(model)
    leaves = [name for name, m in model.named_modules() if isinstance(m, FP8LoraLinear)]
    for name in leaves:
        set_z3_leaf_module(model.get_submodule(name), True)
    return leaves


def prepare_for_fsdp2(model: nn.Module) -> None:
    """Ungroups `model`'s sibling linears (whose stacked FP8 weight would wait from forward to backward) and marks its
    FP8 modules as sharded (`mark_sharded`: no cached FP8 copy of any weight)."""
    ungroup_siblings(model)
    mark_sharded(model)


def sharding(trainer) -> str | None:
    """`"zero3"`, `"fsdp2"` or `None`: how `trainer`'s accelerator shards the parameters."""
    if trainer._dist.is_zero3:
        return "zero3"
    return "fsdp2" if trainer._dist.fsdp_version == 2 else None


def training_device(trainer) -> torch.device | None:
    """Where DeepSpeed moves the models at `train()` (until then they stay where they were loaded, on the CPU): the
    conversion decides for it whether TransformerEngine's linears can run, and builds them there. `None` otherwise
    (the parameters' own device): the Trainer has moved them, or a `device_map` spreads them."""
    return trainer.accelerator.device if trainer.is_deepspeed_enabled else None


@contextmanager
def reference_converted_before_wrapping(trainer):
    """While GRPOTrainer builds: `convert_reference` runs on the reference model right before TRL hands it to
    DeepSpeed (`prepare_deepspeed`) or FSDP (`prepare_fsdp`), whose ZeRO-3 engine or FSDP units hook the modules
    they find then (a linear swapped in later would run on its empty shard). Reward models pass through untouched."""
    originals = {name: getattr(trl_grpo, name) for name in ("prepare_deepspeed", "prepare_fsdp")}

    def converting(original):
        def prepare(model, accelerator):
            if model is getattr(trainer, "ref_model", None):
                convert_reference(trainer, model)
                if original is originals["prepare_fsdp"] and loaded_on_rank_0_only(accelerator):
                    return wrapped_with_rank_0_weights(original, model, accelerator)
            return original(model, accelerator)

        return prepare

    for name, original in originals.items():
        setattr(trl_grpo, name, converting(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(trl_grpo, name, original)


def convert_reference(trainer, ref_model: nn.Module) -> None:
    """The reference model in the learner's FP8 numerics, before DeepSpeed or FSDP wraps it (`FP8GRPOTrainer.__init__`
    converts it afterwards when neither wraps it, and leaves it alone here)."""
    if not trainer.args.fp8_training:
        return
    how = sharding(trainer)
    with warnings.catch_warnings():  # the policy's conversion warns of the same layers
        warnings.simplefilter("ignore")
        recipe, device = trainer.args.resolved_fp8_recipe, training_device(trainer)
        convert_to_fp8(ref_model, recipe, sharded=how is not None, device=device)
    if how == "zero3":
        prepare_for_zero3(ref_model)
    elif how == "fsdp2":
        prepare_for_fsdp2(ref_model)


def loaded_on_rank_0_only(accelerator) -> bool:
    """FSDP2 with `fsdp_cpu_ram_efficient_loading` (TRL's fsdp2.yaml): transformers up to at least 5.17 then loads the
    weights on rank 0 only, the other ranks holding zeros until accelerate's FSDP2 preparation broadcasts rank 0's
    (transformers 5.24 loads them on every rank)."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    return plugin is not None and plugin.fsdp_version == 2 and bool(plugin.cpu_ram_efficient_loading)


def wrapped_with_rank_0_weights(prepare_fsdp, model: nn.Module, accelerator) -> nn.Module:
    """TRL's `prepare_fsdp` with rank 0's weights broadcast into the units afterwards, as accelerate's FSDP2
    preparation does for the policy (`fsdp2_load_full_state_dict`): without it, a reference model loaded on rank 0
    only keeps zeros on the other ranks, and their KL term measures the policy against them."""
    from accelerate.utils.fsdp_utils import fsdp2_load_full_state_dict
    from torch.distributed.fsdp import CPUOffloadPolicy

    full_state = model.state_dict()  # whole, before the units shard it (what counts is rank 0's)
    wrapped = prepare_fsdp(model, accelerator)
    offload = isinstance(accelerator.state.fsdp_plugin.cpu_offload, CPUOffloadPolicy)
    fsdp2_load_full_state_dict(accelerator, wrapped, full_state, cpu_offload=offload)
    return wrapped
