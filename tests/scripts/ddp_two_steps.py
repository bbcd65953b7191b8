"""Run by tests/test_distributed.py under `accelerate launch --num_processes 2`: two FP8 GRPO steps with DDP (gloo),
or with DeepSpeed ZeRO-2 or ZeRO-3, or FSDP2 (tests/scripts/fsdp2_cpu.yaml), when the accelerate config says so, and
the FP8 KV cache; then each rank writes
its final parameters, its sampler's Q/K/V scales and FP8 weights and the learner's to `<output_dir>/rank{r}.pt`.
`--lora`: FP8 + LoRA; `--beta`: a KL term (the reference model loaded from the policy's path, as TRL does); `--moe`:
a tiny Qwen3-MoE; `--save_fp8`: `save_model()` with `fp8_save_format="fp8"` to `<output_dir>/fp8`;
`--gradient_checkpointing`: TRL's default, which the other tests turn off (FSDP's own activation checkpointing is the
accelerate config's)."""

import os
import sys
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from accelerate import PartialState
from peft import LoraConfig
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import holds_its_own_fp8_weight, tiny_grpo_args, tiny_policy  # noqa: E402
from fsdp_on_cpu import allow_fsdp_on_cpu  # noqa: E402

from trl_fp8 import FP8GRPOTrainer, iter_fp8_state  # noqa: E402
from trl_fp8.demo.make_model import build_tokenizer  # noqa: E402
from trl_fp8.demo.task import digit_count_reward as digit_reward  # noqa: E402
from trl_fp8.demo.task import make_dataset  # noqa: E402
from trl_fp8.demo.tiny_moe import tiny_qwen3_moe  # noqa: E402
from trl_fp8.generation.gather import FSDP2Gather, activation_wrappers_set_aside, learner_gather  # noqa: E402
from trl_fp8.quant import FP8Linear, quantize_blockwise  # noqa: E402
from trl_fp8.quant.adapters import unwrap_peft  # noqa: E402
from trl_fp8.quant.kv_cache import calibrate_kv_scales  # noqa: E402
from trl_fp8.quant.lora import FP8LoraLinear  # noqa: E402
from trl_fp8.quant.moe import FP8Experts  # noqa: E402
from trl_fp8.trainers.sharded import training_device  # noqa: E402


def gathered(model):
    """ZeRO-3: the whole parameters, on every rank."""
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(model.parameters()))


@contextmanager
def counting_unshards():
    """Records FSDP2's unit all-gathers (`FSDPModule.unshard`) in the block: the id of each one's FSDP state."""
    units, unshard = [], FSDPModule.unshard

    def counted(self, *args, **kwargs):
        units.append(id(self._get_fsdp_state()))
        return unshard(self, *args, **kwargs)

    FSDPModule.unshard = counted
    try:
        yield units
    finally:
        FSDPModule.unshard = unshard


def fsdp2_gather_states(model, layers) -> list[list[bool]]:
    """Which of the two decoder layers are whole: in an `FSDP2Gather` reading layer 0, then layer 1, then closed."""
    gather, states = FSDP2Gather(model), []

    def whole():
        return [not any(isinstance(p, DTensor) for p in layer.parameters()) for layer in layers]

    for layer in layers:
        with gather(list(layer.parameters())):
            states.append(whole())
    gather.close()
    return [*states, whole()]


def whole(params):
    """FSDP2: each parameter whole (a collective), on every rank."""
    return {n: p.full_tensor() if isinstance(p, DTensor) else p.detach().clone() for n, p in params}


def main(output_dir: str, lora: bool, beta: float, moe: bool, save_fp8: bool, gc: bool):
    fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false") == "true"
    if fsdp:
        allow_fsdp_on_cpu()
    tokenizer = build_tokenizer()
    save_format = "fp8" if save_fp8 else "bf16"
    args = tiny_grpo_args(
        output_dir, learning_rate=0.05, fp8_kv_cache=True, beta=beta, fp8_save_format=save_format,
        gradient_checkpointing=gc,
    )  # fmt: skip
    model = tiny_qwen3_moe(tokenizer) if moe else tiny_policy(tokenizer)
    if beta:  # TRL loads the reference model from the policy's path
        path = Path(output_dir) / "policy"
        if PartialState().is_main_process:
            model.save_pretrained(path)
        PartialState().wait_for_everyone()
        model = str(path)
    trainer = FP8GRPOTrainer(
        model=model,
        reward_funcs=digit_reward,
        args=args,
        train_dataset=make_dataset(32),
        processing_class=tokenizer,
        peft_config=LoraConfig(target_modules="all-linear", lora_dropout=0.0) if lora else None,
    )
    policy = trainer.accelerator.unwrap_model(trainer.model)
    sharded_at_start = any(hasattr(p, "ds_id") for p in policy.parameters())  # ZeRO-3 built it sharded (zero.Init)
    with gathered(policy) if sharded_at_start else nullcontext():
        initial = {n: p.detach().clone() for n, p in policy.named_parameters()}
    trainer.train()
    state = PartialState()
    engine = trainer.vllm_generation
    kv_scales = {
        n: b.clone() for n, b in engine.sampler.named_buffers() if n.endswith(("k_scale", "v_scale", "q_scale"))
    }
    # One more calibration on this rank's latest batch: what this rank measures alone, and what all ranks agree on.
    local = calibrate_kv_scales(trainer.model if fsdp else policy.get_decoder(), *engine.calibration_batch)
    engine.calibrate_kv_scales()
    kv_agreed = engine._kv_scale_invs.clone()
    with counting_unshards() as unshards:
        engine.sync_weights()  # the sampler last synced before the final optimizer step
    if save_fp8:
        trainer.save_model(str(Path(output_dir) / "fp8"))  # every rank: ZeRO-3 gathers as it writes
    empty = [n for n, p in policy.named_parameters() if p.numel() == 0]  # ZeRO-3: sharded between uses
    ref = None if trainer.ref_model is None else trainer.accelerator.unwrap_model(trainer.ref_model)
    ref_grouped = ref is not None and any(m._group() is not None for m in ref.modules() if isinstance(m, FP8Linear))
    zero3 = trainer.is_deepspeed_enabled and trainer.accelerator.state.deepspeed_plugin.zero_stage == 3
    fp8_linears = [m for m in unwrap_peft(policy).modules() if isinstance(m, FP8Linear)]
    wrapped = sum(isinstance(m, ActivationWrapper) for m in policy.modules())  # FSDP's activation checkpointing
    with activation_wrappers_set_aside(policy):  # parameters under the checkpoint's names
        dtensors = [n for n, p in policy.named_parameters() if isinstance(p, DTensor)]  # FSDP2: sharded between uses
    with gathered(policy) if zero3 else nullcontext(), activation_wrappers_set_aside(policy):
        params = whole(policy.named_parameters())
        # Each FP8 layer's cached weight is the quantization of the master weight it holds after the last optimizer
        # step (DeepSpeed writes the updated weights into the parameters without moving their version counters).
        fresh = [] if fsdp else [holds_its_own_fp8_weight(m) for m in fp8_linears]
    with learner_gather(trainer.accelerator, trainer.model) as gather:
        learner_fp8 = {n: t.clone() for n, t in iter_fp8_state(engine.learner(), gather=gather) if "_proj." in n}
    if fsdp:  # FSDP2 caches nothing: the stream's FP8 weights are the quantization of the master weights it holds
        for name in learner_fp8:
            if name.endswith(".weight") and name in params:  # (with LoRA, the stream sends merged weights)
                q, s = quantize_blockwise(params[name], (128, 128))
                fresh.append(bool(torch.equal(learner_fp8[name].view(torch.uint8), q.view(torch.uint8))))
                fresh[-1] &= bool(torch.equal(learner_fp8[f"{name}_scale_inv"], s))
        gather_states = fsdp2_gather_states(trainer.model, unwrap_peft(policy).get_decoder().layers)
        try:  # FSDP2's shards without a gather: refused before anything is read
            list(iter_fp8_state(engine.learner()))
            no_gather = None
        except ValueError as refused:
            no_gather = str(refused)
    torch.save(
        {
            "params": params,
            "initial": initial,
            "kv_scales": kv_scales,
            "kv_local": local,
            "kv_agreed": kv_agreed,
            "world_size": state.num_processes,
            "zero_stage": trainer.accelerator.state.deepspeed_plugin.zero_stage
            if trainer.is_deepspeed_enabled
            else None,
            "fresh_fp8_weights": fresh,
            # Where TE's linears would be chosen for and built: DeepSpeed moves the model there only at train().
            "conversion_device": getattr(training_device(trainer), "type", None),
            "sharded_at_start": sharded_at_start,
            "empty_outside_a_gather": empty,
            "ref_grouped": ref_grouped,
            "zero3_leaves": [n for n, m in policy.named_modules() if getattr(m, "_z3_leaf", False)],
            "fsdp": trainer.is_fsdp_enabled,
            "dtensors": dtensors,
            "activation_wrappers": wrapped,
            "gather_states": gather_states if fsdp else None,
            "stream_without_gather": no_gather if fsdp else None,
            "fp8_caches": sum(m._w_cache is not None for m in fp8_linears),
            "other_fp8_caches": sum(
                bool(m._cache) if isinstance(m, FP8Experts) else m._fp8_cache is not None
                for m in policy.modules()
                if isinstance(m, FP8Experts | FP8LoraLinear)
            ),
            "sync_unshards": len(unshards),
            "sync_units": len(set(unshards)),
            "marked_sharded": sum(getattr(m, "fp8_sharded", False) for m in fp8_linears),
            "log_history": trainer.state.log_history,
            "sampler_fp8": {n: t.clone() for n, t in engine.sampler.state_dict().items() if "_proj." in n},
            "learner_fp8": learner_fp8,
        },
        Path(output_dir) / f"rank{state.process_index}.pt",
    )


if __name__ == "__main__":
    flags = sys.argv[2:]
    beta = 0.04 if "--beta" in flags else 0.0
    main(
        sys.argv[1], "--lora" in flags, beta=beta, moe="--moe" in flags, save_fp8="--save_fp8" in flags,
        gc="--gradient_checkpointing" in flags,
    )  # fmt: skip
