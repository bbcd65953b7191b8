"""The reference sampling engine: a transformers model in vLLM's W8A8 block-FP8 numerics, on any device.

It is a separate copy of the policy, as a colocated vLLM engine is: its converted linears hold the e4m3 weights and
`weight_scale_inv` of the export stream (`trl_fp8.quant.export`) and quantize activations per token in groups of
128 the way vLLM does; attention, norms, embeddings and `lm_head` run in the sampler's dtype, decoding with a KV cache
(`generate`). It is refitted from the learner's stream whenever the learner's weights changed, and returns, for
every sampled token, its log-probability after temperature / min-p / top-k / top-p in vLLM's order (vLLM's
`processed_logprobs`), so that TRL's importance-sampling correction applies to it exactly as it does to vLLM.

It exposes the two methods of TRL's `VLLMGeneration` that `GRPOTrainer` calls (`sync_weights`, `generate`).
"""

import copy
import time
from contextlib import nullcontext

import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
)
from transformers.modeling_utils import set_zero3_state  # "zero.Init already runs": transformers adds none
from trl.trainer.utils import pad

from ..quant.adapters import unwrap_peft
from ..quant.convert import select_fp8_experts, select_fp8_linears
from ..quant.export import load_state_stream, refuse_nonfinite, stream_nbytes
from ..quant.kv_cache import CACHE_KWARG, FP8_QUERY_ATTENTION, KV_SCALE_SUFFIXES, FP8KVCache, set_attention
from ..quant.moe import W8A8Experts
from ..quant.w8a8 import W8A8Linear
from .stream import LearnerStream


def build_sampler_model(
    policy: nn.Module, recipe, *, fp8: bool, dtype: torch.dtype, device: torch.device | str | None = None
) -> nn.Module:
    """An empty copy of `policy`'s architecture in `dtype`, on `device` (by default `policy`'s), with the recipe's
    linears as `W8A8Linear` (and fused MoE experts as per-expert `W8A8Experts`) if `fp8`."""
    config = copy.deepcopy(policy.config)
    config.use_cache = (
        True  # the learner's config may have it off (gradient checkpointing); a sampler decodes with one
    )
    # Under DeepSpeed ZeRO-3 transformers builds every model partitioned (`zero.Init`); the sampler is whole, its own.
    with set_zero3_state():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if device is None:
        device = policy.device if hasattr(policy, "device") else "cpu"
    model.to(device).eval().requires_grad_(False)
    if fp8:
        for name in select_fp8_linears(model, recipe)[0]:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            old = getattr(parent, child)
            new = W8A8Linear(
                old.in_features,
                old.out_features,
                old.bias is not None,
                dtype=dtype,
                device=old.weight.device,
                pow2_scales=recipe.pow2_scales,
            )
            setattr(parent, child, new)
        for name in select_fp8_experts(model, recipe)[0]:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, child, W8A8Experts(getattr(parent, child), dtype=dtype, pow2_scales=recipe.pow2_scales))
    return model


def cast_head_to_fp32(model: nn.Module) -> None:
    """What `GRPOConfig.cast_lm_head_to_fp32` does to the learner, done to a sampler: the head's weight in fp32 and
    its input cast up, so that the sampler's logits, like the learner's, are fp32 products of fp32 weights. A tied
    embedding (sharing the fp32 weight) keeps handing the layers activations in the model's dtype."""
    head = model.get_output_embeddings()
    dtype = head.weight.dtype
    head.float()
    head.register_forward_pre_hook(lambda module, args: (args[0].float(), *args[1:]))
    if getattr(model.config, "tie_word_embeddings", False):
        model.get_input_embeddings().register_forward_hook(lambda module, args, output: output.to(dtype))


# generate() arguments the reference engine sets itself, with what to set instead.
RESERVED_GENERATION_KWARGS = {
    "output_scores": "nothing: the engine returns the sampled tokens' processed log-probs itself",
    "return_dict_in_generate": "nothing: the engine returns the sampled tokens' processed log-probs itself",
    "num_return_sequences": "FP8GRPOConfig.num_generations (TRL samples each prompt that many times)",
    "pad_token_id": "the tokenizer's pad token (TRL pads completions with it)",
    "num_beams": "nothing: GRPO samples, and beam scores are not the sampler's token probabilities",
}


def refuse_reserved(field: str, user_kwargs: dict | None, reserved: dict[str, str]) -> dict:
    """Refuses the keys of config field `field` that an engine sets itself, naming what to set instead; returns a
    copy."""
    user_kwargs = dict(user_kwargs or {})
    for key in user_kwargs:
        if key in reserved:
            what = reserved[key]
            advice = f"remove it ({what.removeprefix('nothing: ')})" if what.startswith("nothing") else f"use {what}"
            raise ValueError(f"{field}[{key!r}] is set by FP8GRPOTrainer's sampling engine; {advice}.")
    return user_kwargs


def check_generation_kwargs(generation_kwargs: dict | None) -> dict:
    """Refuses `generation_kwargs` keys the reference engine owns; returns a copy."""
    return refuse_reserved("generation_kwargs", generation_kwargs, RESERVED_GENERATION_KWARGS)


def left_pad(ids: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(input_ids, attention_mask)` of token-id lists, padded on the left as decoder-only generation wants."""
    rows = [torch.tensor(x, dtype=torch.long) for x in ids]
    input_ids = pad(rows, padding_value=pad_token_id, padding_side="left")
    attention_mask = pad([torch.ones_like(r) for r in rows], padding_value=0, padding_side="left")
    return input_ids, attention_mask


class ReferenceEngine(LearnerStream):
    """FP8 (or high-precision) sampler behind TRL's engine interface.

    Args:
        model (`nn.Module`):
            The learner (possibly wrapped by accelerate); read, never modified.
        accelerator (`accelerate.Accelerator`):
            To unwrap the learner.
        recipe (`FP8Recipe`):
            Which linears are FP8 and with which scale rule, for a learner that is not converted; a converted one's
            own (`fp8_recipe`) is taken instead.
        fp8 (`bool`):
            Sample in W8A8 block FP8 (`True`) or in high precision (`False`).
        dtype (`torch.dtype`):
            The sampler's dtype for everything that is not FP8.
        eos_token_ids (`list[int]`), pad_token_id (`int`):
            Stop tokens and padding.
        temperature, top_p, top_k, min_p, repetition_penalty, max_completion_length, generation_kwargs:
            Sampling parameters, as in `GRPOConfig`.
        kv_cache (`bool`, *optional*, defaults to `False`):
            Store keys and values in E4M3 with per-layer scales that travel in the stream in vLLM's names
            (`model.layers.{i}.self_attn.k_scale` / `v_scale` / `q_scale`), recalibrated from the learner whenever it
            changed.
        kv_scale_percentile (`float`), kv_scale_margin (`float`):
            How scales are derived from the per-token K/V amax (see `trl_fp8.quant.kv_cache`).
        cast_lm_head_to_fp32 (`bool`, *optional*, defaults to `False`):
            Compute the logits with an fp32 `lm_head`, as `GRPOConfig.cast_lm_head_to_fp32` makes the learner do.
        cache_implementation (`str`, *optional*):
            transformers' KV-cache implementation for decoding (`GRPOConfig.cache_implementation`); not with
            `kv_cache`, whose FP8 cache the engine builds itself.
    """

    def __init__(
        self,
        model: nn.Module,
        accelerator,
        recipe,
        *,
        fp8: bool,
        dtype: torch.dtype,
        eos_token_ids: list[int],
        pad_token_id: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float | None = None,
        repetition_penalty: float = 1.0,
        max_completion_length: int = 256,
        generation_kwargs: dict | None = None,
        kv_cache: bool = False,
        kv_scale_percentile: float = 99.9,
        kv_scale_margin: float = 1.05,
        cast_lm_head_to_fp32: bool = False,
        cache_implementation: str | None = None,
    ):
        # The sampler quantizes activations and selects its FP8 linears as the learner it receives weights from.
        recipe = getattr(unwrap_peft(accelerator.unwrap_model(model)), "fp8_recipe", None) or recipe
        if fp8 and tuple(recipe.weight_block_size) != (128, 128):
            raise ValueError(
                f"recipe.weight_block_size {recipe.weight_block_size}: the FP8 sampler takes 128x128 weight blocks "
                "only, as vLLM's block-FP8 kernels do"
            )
        if kv_cache and cache_implementation is not None:
            raise ValueError(
                f"cache_implementation={cache_implementation!r} conflicts with the FP8 KV cache, which the engine "
                "decodes with: unset cache_implementation, or set fp8_kv_cache=False"
            )
        self._init_stream(
            model,
            accelerator,
            recipe,
            fp8=fp8,
            kv_cache=kv_cache,
            kv_scale_percentile=kv_scale_percentile,
            kv_scale_margin=kv_scale_margin,
        )
        # On the training device: DeepSpeed and FSDP move the learner there only when training starts.
        self.sampler = build_sampler_model(self.learner(), recipe, fp8=fp8, dtype=dtype, device=accelerator.device)
        if cast_lm_head_to_fp32:
            cast_head_to_fp32(self.sampler)
        self.eos_token_ids, self.pad_token_id = list(eos_token_ids), pad_token_id
        sampling = dict(
            max_new_tokens=max_completion_length,
            do_sample=True,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            eos_token_id=self.eos_token_ids,
            pad_token_id=pad_token_id,
            use_cache=True,  # decode with a KV cache, whatever the learner's config says
            cache_implementation=cache_implementation,
            disable_compile=True,  # as TRL's transformers path: no auto-compile of the decode under a static cache
        )
        # As in TRL, `generation_kwargs` override the sampling parameters; the scores are the engine's own.
        sampling = {**sampling, **check_generation_kwargs(generation_kwargs)}
        # vLLM filters by min-p between temperature and top-k/top-p (its sampler's steps 7b-7d); transformers after
        # them, where top-p's cut falls elsewhere: given to generate() as processors, which it runs before top-k/p.
        self.logits_processor = LogitsProcessorList()
        if sampling.get("min_p") is not None:
            temperature = sampling.get("temperature")
            if temperature is not None and temperature != 1.0:
                self.logits_processor.append(TemperatureLogitsWarper(temperature))
            self.logits_processor.append(MinPLogitsWarper(sampling["min_p"]))
            sampling.update(temperature=1.0, min_p=None)
        self.generation_config = GenerationConfig(
            **sampling,
            output_scores=True,  # the processed logits, for the sampled tokens' log-probs
            return_dict_in_generate=True,
        )
        eos = self.generation_config.eos_token_id  # completions end where generate() stops
        self.eos_token_ids = [eos] if isinstance(eos, int) else list(eos)
        if kv_cache:
            # vLLM's checkpoint names; -1 marks "never received", so a missing scale can never pass as 1.0.
            for name in self._attn_names:
                module = self.sampler.get_submodule(name)
                for scale in ("k_scale", "v_scale", "q_scale"):
                    module.register_buffer(scale, torch.tensor(-1.0, device=self.sampler.device))
            # Queries go through E4M3 with `q_scale`, as in vLLM's FP8-KV attention.
            set_attention(self.sampler, self._attn_names, FP8_QUERY_ATTENTION)

    @torch.no_grad()
    def sync_weights(self) -> None:
        """Refits the sampler from the learner's stream, if the learner's weights changed since the last sync."""
        versions = self.learner_changed()
        if versions is None:
            return
        kv_scale_invs, calibration_seconds = self._sync_kv_scales()
        start = time.perf_counter()
        pairs = self.state_stream(kv_scale_invs)
        sent, bf16 = stream_nbytes(pairs)
        # The learner's high-precision tensors (embeddings, norms, lm_head, biases) arrive in its dtype, often fp32
        # (TRL loads models in fp32); the sampler runs in bf16 under bf16=True, and vLLM would cast them too. FP8 codes
        # and scales arrive exactly as quantized, and load_state_stream checks that.
        held = self.sampler.state_dict(keep_vars=True)
        pairs = [(name, t.to(self.sampler.device, _sampler_dtype(name, t, held.get(name)))) for name, t in pairs]
        refuse_nonfinite(pairs)  # after the cast: an fp32 weight past fp16's range would load as inf
        load_state_stream(self.sampler, pairs)
        self._hold_kv_scales(kv_scale_invs)
        self._synced_versions = versions
        self.last_sync = {"seconds": time.perf_counter() - start, "bytes": sent, "bf16_bytes": bf16}
        if self.kv_cache:
            self.last_sync["kv_calibration_seconds"] = calibration_seconds

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], images=None, num_generations: int = 1, profiler=None) -> tuple:
        """Samples one completion per entry of `prompts` (token ids; TRL repeats each prompt `num_generations`
        times). Returns `(prompt_ids, completion_ids, logprobs, None)` like TRL's `VLLMGeneration.generate`, with
        `logprobs[i][t] == [log-prob of the sampled token]`, completions cut after the first stop token."""
        if images is not None and any(img is not None for img in images):
            raise NotImplementedError("the reference engine samples text only; images are not supported")
        device = self.sampler.device
        input_ids, attention_mask = left_pad(prompts, self.pad_token_id)
        width = input_ids.shape[1]
        cache = None
        if self.kv_cache:
            attn = [self.sampler.get_submodule(name) for name in self._attn_names]
            cache = FP8KVCache({a.layer_idx: (a.k_scale.item(), a.v_scale.item()) for a in attn}, self.sampler.config)
            for a in attn:
                if not a.q_scale.item() > 0:
                    raise ValueError(
                        f"FP8 KV cache: layer {a.layer_idx} has no valid q_scale ({a.q_scale.item()}); sync first"
                    )
        with profiler or nullcontext():
            out = self.sampler.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                generation_config=self.generation_config,
                logits_processor=self.logits_processor,
                **{CACHE_KWARG: cache},
            )
        sampled = out.sequences[:, width:]
        # `scores` are the processed logits (temperature, min-p, top-k/p applied): their log-softmax is what vLLM
        # returns. One step at a time: all of them at once in fp32 would be batch x tokens x vocab (GBs at 150k).
        token_logps = torch.stack(
            [s.float().log_softmax(-1).gather(-1, sampled[:, t, None]).squeeze(-1) for t, s in enumerate(out.scores)],
            dim=1,
        ).cpu()
        sampled = sampled.cpu()
        completion_ids, logprobs = [], []
        stops = torch.tensor(self.eos_token_ids)
        for row, row_logps in zip(sampled, token_logps, strict=True):
            stop = torch.isin(row, stops).nonzero()
            length = int(stop[0]) + 1 if len(stop) else len(row)
            completion_ids.append(row[:length].tolist())
            logprobs.append([[lp] for lp in row_logps[:length].tolist()])
        return [list(p) for p in prompts], completion_ids, logprobs, None


_HIGH_PRECISION = (torch.float32, torch.bfloat16, torch.float16)


def _sampler_dtype(name: str, tensor: torch.Tensor, held: torch.Tensor | None) -> torch.dtype:
    """The dtype a streamed tensor is loaded in: the sampler's, for high-precision weights; else (FP8 codes, scales)
    its own, which `load_state_stream` holds to the sampler's."""
    scale = name.endswith(("_scale_inv", *KV_SCALE_SUFFIXES))  # not a weight of the model named `..._scale`
    if held is not None and not scale and tensor.dtype in _HIGH_PRECISION and held.dtype in _HIGH_PRECISION:
        return held.dtype
    return tensor.dtype
