"""What FP8GRPOTrainer refuses at start, before TRL loads or wraps anything: each check raises naming the field or
setting, so a failed start changes nothing."""

import copy
import importlib.metadata
import logging
import os

import torch
from accelerate.utils import is_peft_model
from packaging.version import Version
from torch import nn

from ..quant.adapters import unwrap_peft
from ..quant.backends import available_backends, resolve_backend
from ..quant.kv_cache import check_kv_cache_supported
from ..quant.te_linear import te_recipe_status
from .fp8_grpo_config import FP8GRPOConfig


logger = logging.getLogger(__name__)


# LoraConfig fields whose adapters cannot be merged into the one weight that learner and sampler share in FP8.
_UNMERGEABLE_LORA = {
    "lora_dropout": "with fp8_training the adapters train on their merged weight, and dropout on their input "
    "cannot be merged into it; set lora_dropout=0",
    "use_dora": "DoRA's magnitude vector is not supported with FP8",
    "lora_bias": "adapter biases are not supported with FP8",
    "modules_to_save": "fully trained module copies are not streamed to the FP8 sampler yet",
    "trainable_token_indices": "trainable tokens are not streamed to the FP8 sampler yet",
    "target_parameters": "LoRA on bare parameters (MoE experts) is not supported with FP8; target linears",
}


def check_peft_config(peft_config, fp8_training: bool) -> None:
    """Refuses, before TRL wraps the model, a `peft_config` FP8 + LoRA cannot train (see `trl_fp8.quant.lora`);
    dropout only with `fp8_training` (a high-precision learner trains with PEFT's own forward)."""
    from peft import LoraConfig

    if not isinstance(peft_config, LoraConfig):
        raise ValueError(f"peft_config: FP8GRPOTrainer supports LoraConfig, not {type(peft_config).__name__}")
    for field, why in _UNMERGEABLE_LORA.items():
        value = getattr(peft_config, field, None)
        if value and (fp8_training or field != "lora_dropout"):
            raise ValueError(f"LoraConfig.{field}={value!r} is not supported by FP8GRPOTrainer: {why}")


def _meta_skeleton(model, args: FP8GRPOConfig):
    """An empty (meta-device) copy of the policy's architecture (`model`: a loaded model or a path), or `None` where
    it cannot be built. No weights are read."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        if isinstance(model, str):
            revision = (args.model_init_kwargs or {}).get("revision")
            config = AutoConfig.from_pretrained(model, revision=revision, trust_remote_code=args.trust_remote_code)
        else:
            config = model.config
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, trust_remote_code=args.trust_remote_code)
    except Exception:
        return None


def check_peft_targets(model, peft_config, args: FP8GRPOConfig) -> None:
    """Wraps an empty (meta-device) copy of the policy's architecture with `peft_config` and refuses what PEFT would
    build there that FP8 cannot carry (adapters on embeddings, LoRA variants, tied targets; see
    `trl_fp8.quant.lora.check_peft_supported`): TRL wraps the real model in place, so this must come first."""
    from peft import get_peft_model

    from ..quant.lora import check_peft_supported

    skeleton = _meta_skeleton(model, args)
    if skeleton is None:
        return
    try:
        with torch.device("meta"):
            skeleton = get_peft_model(skeleton, copy.deepcopy(peft_config))
    except Exception:  # an initialization the skeleton cannot take: checked after TRL wraps the model
        return
    check_peft_supported(skeleton.get_base_model(), allow_dropout=not args.fp8_training)  # the checkpoint's names


def check_fp8_architecture(model, args: FP8GRPOConfig, *, warn: bool) -> None:
    """Before TRL loads the policy or starts vLLM, on an empty copy of its architecture: refuses a model FP8 cannot
    reach (no `...layers.{i}` blocks) whether FP8 is on for training, sampling or both, and (`warn`) names what stays
    in high precision, as `convert_to_fp8` does where the learner is converted (with FP8 sampling only, nothing
    else would say it)."""
    from ..quant.convert import check_fp8_selection

    # A loaded model is read as it is (the selection changes nothing); a path, or a PEFT model, through an empty copy
    # of its architecture. One that cannot be built is left to the conversion, with fp8_training.
    plain = isinstance(model, nn.Module) and not is_peft_model(model)
    skeleton = model if plain else _meta_skeleton(model, args)
    if skeleton is not None:  # (warnings at stacklevel 4: the line that built the trainer)
        check_fp8_selection(skeleton, args.resolved_fp8_recipe, warn=warn, stacklevel=4)


# The oldest releases FSDP2 was tested with (tests/test_fsdp.py); below them it is refused at start.
FSDP2_FLOORS = {"torch": "2.10", "accelerate": "1.15"}


def installed_version(package: str) -> str:
    return importlib.metadata.version(package).split("+")[0]


def fsdp2_packages_too_old() -> list[str]:
    """The installed packages older than `FSDP2_FLOORS`, each as "torch 2.9.1 (FSDP2 needs >= 2.10)"."""
    return [
        f"{package} {installed_version(package)} (FSDP2 needs >= {floor})"
        for package, floor in FSDP2_FLOORS.items()
        if Version(installed_version(package)) < Version(floor)
    ]


def check_fsdp_supported(args: FP8GRPOConfig, lora: bool = False) -> int | None:
    """The FSDP version `TrainingArguments` (`fsdp`, `fsdp_config["version"]`, 2 by default) or `accelerate launch`
    (`ACCELERATE_USE_FSDP`, `FSDP_VERSION`, 1 by default) ask for, or `None`. Refuses FSDP1 at start: its flat
    parameters are views the FP8 modules cannot read whole between forwards (FSDP2 gathers each unit for the
    stream); FSDP2 is supported. With FP8 + LoRA (`lora`), refuses units chosen by size: one could be a LoRA layer's
    base linear, whose weight the FP8 LoRA layer reads without running it, so FSDP would never gather it."""
    if args.fsdp:
        version = int((args.fsdp_config or {}).get("version", 2))
        by_size = int((args.fsdp_config or {}).get("min_num_params", 0)) > 0
    elif os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        version = int(os.environ.get("FSDP_VERSION", "1"))
        by_size = os.environ.get("FSDP_AUTO_WRAP_POLICY", "") == "SIZE_BASED_WRAP"
    else:
        return None
    if version != 2:
        raise NotImplementedError(
            f"FP8GRPOTrainer supports FSDP2, not FSDP{version}: set `fsdp_version: 2` in the accelerate config "
            "(examples/accelerate_configs/fsdp2_8gpu.yaml) or fsdp_config={'version': 2}; or use DeepSpeed ZeRO-2 "
            "(examples/accelerate_configs/zero2_8gpu.yaml), as the recipes do, or ZeRO-3."
        )
    too_old = fsdp2_packages_too_old()
    if too_old:
        raise NotImplementedError(
            f"FP8GRPOTrainer under FSDP2 needs newer packages than the rest of trl-fp8: {', '.join(too_old)}. "
            "Those are the oldest it was tested with: on two CPU processes, torch 2.9's FSDP2 computed gradients that "
            "differ from DDP's, and accelerate 1.14 wraps other modules for activation checkpointing. Upgrade them, "
            "or use DeepSpeed ZeRO-2 (the recipes' layout) or ZeRO-3."
        )
    if lora and by_size and args.fp8_training:
        raise NotImplementedError(
            "FP8 + LoRA under FSDP2 needs a unit per decoder layer (fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP, "
            "as examples/accelerate_configs/fsdp2_8gpu.yaml), not units chosen by size (SIZE_BASED_WRAP / "
            "min_num_params): a LoRA layer's base linear made a unit of its own would never be gathered, since the "
            "FP8 LoRA layer reads its weight without running it"
        )
    return version


def check_backend_runs_here(recipe, device: torch.device, sharded: bool = False) -> None:
    """Refuses a backend the training device (or sharded parameters, `sharded`: DeepSpeed ZeRO-3, FSDP2) cannot run
    before GRPOTrainer loads anything (models, vLLM) and before the user's model is converted: nothing is changed by
    a failed start."""
    if recipe.backend == "te" and sharded:
        raise RuntimeError(
            "FP8 backend 'te' does not run on sharded parameters (DeepSpeed ZeRO-3, FSDP2) yet (TransformerEngine's "
            "linears copy whole weights and cache their FP8 copies): use backend='auto', which takes trl-fp8's "
            "kernels there, or ZeRO-2"
        )
    if recipe.backend == "te":
        ok, why = te_recipe_status(recipe.pow2_scales)
        if not (ok and device.type == "cuda"):
            raise RuntimeError(f"FP8 backend 'te' cannot run here: {why if not ok else f'training runs on {device}'}")
    elif recipe.backend != "auto":
        resolve_backend(recipe.backend, device)


def warn_emulated_on_gpu(backend: str, recipe, device: torch.device) -> None:
    """Warns when `backend="auto"` (or `"te"`, for the linears TE does not take) leaves FP8 training on a GPU to the
    `emulated` oracle: the recipe's numerics, but dequantized fp32 matmuls, slower than BF16 training. A user who
    switched trainers for speed on a GPU without FP8 GEMMs here (Ampere, Ada) would otherwise only find it in the
    `fp8/backend/emulated` metric. Naming `emulated` yourself, or training on the CPU, warns of nothing."""
    if backend != "emulated" or recipe.backend not in ("auto", "te") or device.type != "cuda":
        return
    if list(recipe.weight_block_size) != [128, 128]:
        why = f"weight_block_size={list(recipe.weight_block_size)}: the fast GEMMs take 128x128 weight blocks only"
    else:
        why = "; ".join(
            f"{name}: {status}" for name, status in available_backends(device).items() if name != "emulated"
        )
    logger.warning(
        "trl-fp8: FP8 training on %s runs on the 'emulated' backend, as no fast FP8 GEMM runs here (%s). It keeps "
        "the recipe's numerics but dequantizes to fp32 for every matmul, so steps are slower than BF16 training. "
        "FP8 training is faster on Hopper (SM90) with torch >= 2.10 built for CUDA >= 12.9, or with "
        "TransformerEngine. On this GPU, fp8_training=False keeps FP8 generation and trains in high precision "
        "(NeMo RL's FP8-generation-only run scored below end-to-end FP8 and BF16).",
        device,
        why,
    )


# generation_kwargs keys that process the logits the sampler's log-probs are read from, with their neutral values.
LOGITS_PROCESSOR_KWARGS = {
    "no_repeat_ngram_size": (None, 0), "suppress_tokens": (None, []), "begin_suppress_tokens": (None, []),
    "bad_words_ids": (None, []), "sequence_bias": (None, {}), "min_new_tokens": (None, 0), "min_length": (None, 0),
    "typical_p": (None, 1.0), "epsilon_cutoff": (None, 0.0), "eta_cutoff": (None, 0.0), "top_h": (None,),
    "min_tokens": (None, 0), "bad_words": (None, []), "presence_penalty": (None, 0.0),
    "frequency_penalty": (None, 0.0), "logit_bias": (None, {}), "allowed_token_ids": (None,),
}  # fmt: skip


def warn_truncated_sampling(args: FP8GRPOConfig) -> None:
    """Warns once when sampling is truncated or penalized (`top_k`, `top_p`, `min_p`, `repetition_penalty`, in the
    config or `generation_kwargs`; the other logits processors of `generation_kwargs`, `LOGITS_PROCESSOR_KWARGS`; or
    vLLM's structured outputs) while TRL corrects for the sampler: both engines
    return the log-probs of the distribution they sampled from (vLLM's `processed_logprobs`, as TRL asks of vLLM;
    vLLM masks the logits with the regex's grammar before either kind of log-probs), which for the sampled tokens
    mostly exceed the learner's, so the ratios run below 1 and scale the updates down. TRL's own transformers path,
    which has no separate sampler, never shows this. Also warns that the reference engine, like TRL's transformers
    path, does not apply `vllm_structured_outputs_regex`, and when `generation_kwargs` sets another temperature than
    the learner's log-probs use."""
    regex = args.vllm_structured_outputs_regex
    overrides = args.generation_kwargs if isinstance(args.generation_kwargs, dict) else {}
    if regex is not None and not args.use_vllm:
        logger.warning(
            "trl-fp8: vllm_structured_outputs_regex=%r applies to vLLM only: the FP8 reference engine (use_vllm=False)"
            " samples without it, as TRL's transformers path does.",
            regex,
        )
    if not args.vllm_importance_sampling_correction:
        return
    settings = {
        "top_k": args.top_k,
        "top_p": args.top_p,
        "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
    }
    settings |= {k: v for k, v in overrides.items() if k in settings}
    truncating = {
        "top_k": lambda v: v not in (None, 0, -1),
        "top_p": lambda v: v is not None and v < 1,
        "min_p": lambda v: v is not None and v > 0,
        "repetition_penalty": lambda v: v is not None and v != 1,
    }
    truncations = [f"{k}={v}" for k, v in settings.items() if truncating[k](v)]
    # Other logits processors (transformers' and vLLM's names) change the distribution the sampler returns log-probs
    # of as well.
    truncations += [
        f"generation_kwargs[{k!r}]={v!r}"
        for k, v in overrides.items()
        if k in LOGITS_PROCESSOR_KWARGS and v not in LOGITS_PROCESSOR_KWARGS[k]
    ]
    if overrides.get("temperature", args.temperature) != args.temperature:
        logger.warning(
            "trl-fp8: generation_kwargs['temperature']=%s samples at another temperature than the learner's "
            "log-probs use (temperature=%s): the importance-sampling ratios correct for that gap as for FP8, and "
            "`sampling/token_mult_prob_error` measures it with FP8's. Set `temperature` instead.",
            overrides["temperature"],
            args.temperature,
        )
    if args.use_vllm and regex is not None:
        truncations.append(f"vllm_structured_outputs_regex={regex!r}")
    elif args.use_vllm and overrides.get("structured_outputs") is not None:
        truncations.append("generation_kwargs['structured_outputs']")
    if truncations:
        logger.warning(
            "trl-fp8: sampling is truncated or penalized (%s). The sampler returns the log-probs of the distribution "
            "it sampled from, as vLLM does for TRL, so the importance-sampling ratios run below 1 and scale the "
            "updates down (see `sampling/importance_sampling_ratio/mean`); unset them to sample from the full "
            "distribution.",
            ", ".join(truncations),
        )


def check_text_prompts(args: FP8GRPOConfig, **datasets) -> None:
    """Refuses, at start, prompts with images (an `image` column, images in the first row's `images`, or image parts
    in the first prompt's messages, where TRL looks for them) in the `datasets` given (`train_dataset=...`,
    `eval_dataset=...`, each a dataset or a dict of them) while the FP8 reference engine samples (`use_vllm=False`):
    it samples text only, and would say so only at the first generation, after everything is loaded."""
    from trl.data_utils import get_dataset_column_names, is_conversational

    if args.use_vllm:
        return
    for field, given in datasets.items():
        for key, dataset in given.items() if isinstance(given, dict) else [(None, given)]:
            if dataset is None:
                continue
            where = field if key is None else f"{field}[{key!r}]"
            columns = get_dataset_column_names(dataset)
            first = next(iter(dataset), None) if {"prompt", "images"} & set(columns) else None
            found = "has an 'image' column" if "image" in columns else None
            # As TRL: a batch whose `images` are all empty lists has no images (a text dataset with the column).
            if found is None and "images" in columns and first is not None and first["images"]:
                found = "has images in its first row's 'images'"
            if found is None and first is not None and "prompt" in columns and is_conversational(first):
                parts = [p for m in first["prompt"] if isinstance(m.get("content"), list) for p in m["content"]]
                if any(isinstance(p, dict) and p.get("type") == "image" for p in parts):
                    found = "has image parts in its first prompt"
            if found:
                raise ValueError(
                    f"{where} {found}, but FP8GRPOTrainer's FP8 reference engine (use_vllm=False) samples text "
                    "only: train on text prompts, or sample with vLLM (use_vllm=True)."
                )


def check_not_quantized(model, quantization_config, args: FP8GRPOConfig) -> None:
    """Refuses a policy loaded quantized (bitsandbytes, GPTQ, a block-FP8 checkpoint transformers keeps in FP8 on a
    GPU, ...) while FP8 is on: the learner's FP8 linears and the sampler's weights are quantized from the policy's
    high-precision weights, which such a model no longer holds. `model` is a path (then only `quantization_config`,
    the trainer's argument, and `args.model_init_kwargs` can say so before loading) or a loaded model."""
    if not (args.fp8_training or args.fp8_generation):
        return
    from_args = (args.model_init_kwargs or {}).get("quantization_config")
    if quantization_config is not None:
        where, config = "quantization_config (the trainer's argument)", quantization_config
    elif from_args is not None:
        where, config = "model_init_kwargs['quantization_config']", from_args
    elif getattr(model, "is_quantized", False) is True:  # transformers: loaded through a quantizer
        where, config = "the model (loaded quantized)", model.hf_quantizer.quantization_config
    else:
        return
    method = config.get("quant_method") if isinstance(config, dict) else getattr(config, "quant_method", config)
    raise ValueError(
        f"{where}: the policy is quantized ({getattr(method, 'value', method)}), but FP8GRPOTrainer quantizes the "
        "policy's high-precision weights itself, for the learner (fp8_training) and the sampler (fp8_generation). "
        "Load it in bf16: FP8 + LoRA trains adapters over an FP8 base as QLoRA does over a 4-bit one (a block-FP8 "
        "checkpoint loads in bf16 with FineGrainedFP8Config(dequantize=True)); or set fp8_training=False and "
        "fp8_generation=False."
    )


def check_fp8_kv_cache(model, args: FP8GRPOConfig) -> None:
    """Refuses, before the model given is converted or a path is loaded (its empty copy is checked), a policy whose
    KV cache the FP8 KV cache cannot hold (`trl_fp8.quant.kv_cache.check_kv_cache_supported`)."""
    if not args.fp8_kv_cache:
        return
    skeleton = model if isinstance(model, nn.Module) else _meta_skeleton(model, args)
    if skeleton is not None:
        check_kv_cache_supported(skeleton)


def check_not_converted(model, args: FP8GRPOConfig) -> None:
    """Refuses a policy an earlier trainer (or `convert_to_fp8`) already converted, unless with this run's recipe:
    with `fp8_training=False` its linears would go on training in FP8 while the run says otherwise (nothing converts
    them back); with another recipe its linears keep the old one. Before TRL wraps it (a `peft_config`)."""
    policy = unwrap_peft(model) if isinstance(model, nn.Module) else None
    previous = getattr(policy, "fp8_recipe", None)
    if previous is None:
        return
    if not args.fp8_training:
        raise ValueError(
            f"fp8_training=False, but the model given was already converted to FP8 ({previous}) and its "
            "linears would train in FP8: pass a fresh, unconverted model (e.g. load it again), or set "
            "fp8_training=True."
        )
    if previous != args.resolved_fp8_recipe:
        raise ValueError(
            f"fp8_recipe: the model given was already converted to FP8 with {previous}, and its linears keep that "
            f"recipe, not {args.resolved_fp8_recipe}: pass a fresh, unconverted model (e.g. load it again), or "
            "fp8_recipe equal to the model's."
        )
