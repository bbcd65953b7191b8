"""The reference sampling engine: a transformers model in vLLM's W8A8 block-FP8 numerics, on any device.

It is a separate copy of the policy, as a colocated vLLM engine is: its converted linears hold the e4m3 weights and
`weight_scale_inv` of the export stream (DESIGN §3) and quantize activations per token in groups of 128 the way
vLLM does; attention, norms, embeddings and `lm_head` run in the sampler's dtype, decoding with a KV cache
(`generate`). It is refitted from the learner's stream whenever the learner's weights changed, and returns, for
every sampled token, its log-probability after temperature / top-k / top-p (vLLM's `processed_logprobs`), so that
TRL's importance-sampling correction applies to it exactly as it does to vLLM.

It exposes the two methods of TRL's `VLLMGeneration` that `GRPOTrainer` calls (`sync_weights`, `generate`).
"""

import copy
import time
from contextlib import nullcontext

import torch
from torch import nn
from transformers import AutoModelForCausalLM, GenerationConfig

from ..quant.convert import select_fp8_experts, select_fp8_linears
from ..quant.export import iter_fp8_state, iter_hp_state, load_state_stream, stream_nbytes
from ..quant.linear import weights_epoch
from ..quant.moe import W8A8Experts
from ..quant.w8a8 import W8A8Linear


def build_sampler_model(policy: nn.Module, recipe, *, fp8: bool, dtype: torch.dtype) -> nn.Module:
    """An empty copy of `policy`'s architecture in `dtype`, with the recipe's linears as `W8A8Linear` (and fused
    MoE experts as per-expert `W8A8Experts`) if `fp8`."""
    config = copy.deepcopy(policy.config)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.to(policy.device if hasattr(policy, "device") else "cpu").eval().requires_grad_(False)
    if fp8:
        for name in select_fp8_linears(model, recipe)[0]:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            old = getattr(parent, child)
            new = W8A8Linear(
                old.in_features, old.out_features, old.bias is not None, dtype=dtype, device=old.weight.device
            )
            setattr(parent, child, new)
        for name in select_fp8_experts(model, recipe)[0]:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, child, W8A8Experts(getattr(parent, child), dtype=dtype))
    return model


class ReferenceEngine:
    """FP8 (or high-precision) sampler behind TRL's engine interface.

    Args:
        model (`nn.Module`):
            The learner (possibly wrapped by accelerate); read, never modified.
        accelerator (`accelerate.Accelerator`):
            To unwrap the learner.
        recipe (`FP8Recipe`):
            Which linears are FP8 and with which scale rule (used when the learner itself is not converted).
        fp8 (`bool`):
            Sample in W8A8 block FP8 (`True`) or in high precision (`False`).
        dtype (`torch.dtype`):
            The sampler's dtype for everything that is not FP8.
        eos_token_ids (`list[int]`), pad_token_id (`int`):
            Stop tokens and padding.
        temperature, top_p, top_k, min_p, repetition_penalty, max_completion_length, generation_kwargs:
            Sampling parameters, as in `GRPOConfig`.
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
    ):
        self.model, self.accelerator, self.recipe, self.fp8 = model, accelerator, recipe, fp8
        self.sampler = build_sampler_model(accelerator.unwrap_model(model), recipe, fp8=fp8, dtype=dtype)
        self.eos_token_ids, self.pad_token_id = list(eos_token_ids), pad_token_id
        self.generation_config = GenerationConfig(
            max_new_tokens=max_completion_length,
            do_sample=True,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            eos_token_id=self.eos_token_ids,
            pad_token_id=pad_token_id,
            output_scores=True,  # the processed logits, for the sampled tokens' log-probs
            return_dict_in_generate=True,
            **(generation_kwargs or {}),
        )
        self._synced_versions: tuple | None = None
        self.last_sync: dict[str, float] | None = None

    def state_stream(self) -> list[tuple[str, torch.Tensor]]:
        """What the learner sends: block-FP8 pairs for an FP8 sampler, its own tensors for a high-precision one."""
        policy = self.accelerator.unwrap_model(self.model)
        if not self.fp8:
            return list(iter_hp_state(policy))
        # A converted learner sends its own cached quantization; an unconverted one is quantized by the recipe.
        converted = getattr(policy, "fp8_recipe", None) is not None
        return list(iter_fp8_state(policy, None if converted else self.recipe))

    @torch.no_grad()
    def sync_weights(self) -> None:
        """Refits the sampler from the learner's stream, if the learner's weights changed since the last sync."""
        policy = self.accelerator.unwrap_model(self.model)
        versions = (weights_epoch(), *(p._version for p in policy.parameters()))
        if versions == self._synced_versions:
            return
        start = time.perf_counter()
        pairs = self.state_stream()
        sent, bf16 = stream_nbytes(pairs)
        pairs = [(name, t.to(self.sampler.device)) for name, t in pairs]
        load_state_stream(self.sampler, pairs)
        self._synced_versions = versions
        self.last_sync = {"seconds": time.perf_counter() - start, "bytes": sent, "bf16_bytes": bf16}

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], images=None, num_generations: int = 1, profiler=None) -> tuple:
        """Samples one completion per entry of `prompts` (token ids; TRL repeats each prompt `num_generations`
        times). Returns `(prompt_ids, completion_ids, logprobs, None)` like TRL's `VLLMGeneration.generate`, with
        `logprobs[i][t] == [log-prob of the sampled token]`, completions cut after the first stop token."""
        if images is not None and any(img is not None for img in images):
            raise NotImplementedError("the reference engine samples text only; images are not supported")
        device = self.sampler.device
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for i, ids in enumerate(prompts):  # left padding, as vLLM sees each prompt unpadded
            input_ids[i, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention_mask[i, width - len(ids) :] = 1
        with profiler or nullcontext():
            out = self.sampler.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                generation_config=self.generation_config,
            )
        sampled = out.sequences[:, width:]
        # `scores` are the processed logits (temperature, top-k/p applied): their log-softmax is what vLLM returns.
        logps = torch.stack([s.float().log_softmax(-1) for s in out.scores], dim=1)
        token_logps = logps.gather(-1, sampled.unsqueeze(-1)).squeeze(-1).cpu()
        sampled = sampled.cpu()
        completion_ids, logprobs = [], []
        stops = torch.tensor(self.eos_token_ids)
        for row, row_logps in zip(sampled, token_logps, strict=True):
            stop = torch.isin(row, stops).nonzero()
            length = int(stop[0]) + 1 if len(stop) else len(row)
            completion_ids.append(row[:length].tolist())
            logprobs.append([[lp] for lp in row_logps[:length].tolist()])
        return [list(p) for p in prompts], completion_ids, logprobs, None
