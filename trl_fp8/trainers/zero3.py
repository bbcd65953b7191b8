"""DeepSpeed glue: FP8 modules that read other modules' weights under ZeRO-3, and the reference model converted before
DeepSpeed wraps it.

ZeRO-3 keeps each parameter sharded and gathers a module's own parameters only while that module runs (hooks before
its forward and its backward). Two kinds of FP8 module read parameters of other modules: sibling linears
(`trl_fp8.quant.siblings`: q_proj runs the stacked GEMM of q, k and v) and FP8 LoRA layers (`trl_fp8.quant.lora`:
the base layer's weight merged with the adapters'). Siblings run alone under ZeRO-3 (one GEMM each, as without
`fuse_siblings`); each FP8 LoRA layer becomes a DeepSpeed "leaf" (`deepspeed.utils.set_z3_leaf_module`, made for
MoE blocks), gathered with everything beneath it. Both must happen before DeepSpeed builds its engine, which
registers the hooks.
"""

import warnings
from contextlib import contextmanager

import trl.trainer.grpo_trainer as trl_grpo
from torch import nn

from ..quant.convert import convert_to_fp8
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


@contextmanager
def reference_converted_before_deepspeed(trainer):
    """While GRPOTrainer builds: `convert_reference` runs on the reference model right before TRL hands it to
    DeepSpeed (`prepare_deepspeed`), whose ZeRO-3 engine hooks the modules it finds then (a linear swapped in later
    would run on its empty shard). Reward models pass through untouched."""
    original = trl_grpo.prepare_deepspeed

    def prepare(model, accelerator):
        if model is getattr(trainer, "ref_model", None):
            convert_reference(trainer, model)
        return original(model, accelerator)

    trl_grpo.prepare_deepspeed = prepare
    try:
        yield
    finally:
        trl_grpo.prepare_deepspeed = original


def convert_reference(trainer, ref_model: nn.Module) -> None:
    """The reference model in the learner's FP8 numerics, before DeepSpeed wraps it (`FP8GRPOTrainer.__init__`
    converts it afterwards when DeepSpeed does not wrap it, and leaves it alone here)."""
    if not trainer.args.fp8_training:
        return
    zero3 = trainer._dist.is_zero3
    with warnings.catch_warnings():  # the policy's conversion warns of the same layers
        warnings.simplefilter("ignore")
        convert_to_fp8(ref_model, trainer.args.resolved_fp8_recipe, sharded=zero3)
    if zero3:
        prepare_for_zero3(ref_model)
