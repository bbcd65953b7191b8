"""The sampler/learner mismatch metrics FP8GRPOTrainer logs each step, under NeMo RL's names:
`sampling/token_mult_prob_error`, `sampling/gen_kl`, `sampling/is_oob_ratio`, and for MoE models on the reference
engine `fp8/router_mismatch`."""

import torch

from ..quant.moe import capture_routing, is_fused_experts


class MismatchMetrics:
    """Mixin for a GRPOTrainer: `_log_mismatch` and `_log_router_mismatch` append to `self._metrics[mode]`; every
    figure is a token mean over all ranks."""

    @property
    def _is_moe(self) -> bool:
        if not hasattr(self, "_is_moe_cache"):
            self._is_moe_cache = any(is_fused_experts(m) for m in self.accelerator.unwrap_model(self.model).modules())
        return self._is_moe_cache

    @torch.no_grad()
    def _log_router_mismatch(self, output, mode: str) -> None:
        """One extra forward of each model on the batch (MoE only), recording the experts each token is sent to."""
        input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        sampler = self.vllm_generation.sampler
        learner = self.accelerator.unwrap_model(self.model)
        with capture_routing(sampler) as sampled:
            sampler(input_ids=input_ids.to(sampler.device), attention_mask=attention_mask.to(sampler.device))
        with capture_routing(learner) as learned:
            learner(input_ids=input_ids, attention_mask=attention_mask)
        valid = attention_mask.flatten().bool().cpu()
        differ = sum(
            int((s.sort(-1).values != t.sort(-1).values).any(-1)[valid].sum())
            for s, t in zip(sampled, learned, strict=True)
        )
        counts = torch.tensor([[float(differ), float(valid.sum()) * len(sampled)]], device=self.accelerator.device)
        differ, total = self.accelerator.gather(counts).sum(0).tolist()
        if total > 0:
            self._metrics[mode]["fp8/router_mismatch"].append(differ / total)

    @torch.no_grad()
    def _learner_logps(self, output, mode: str) -> torch.Tensor:
        """Learner log-probs of the sampled tokens, for metrics when TRL did not compute them (IS off), in chunks of
        the mode's batch size, as TRL's own forwards."""
        input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        logps, _, _ = self._get_per_token_logps_and_entropies(
            self.model,
            input_ids,
            attention_mask,
            output["completion_ids"].size(1),
            batch_size=self.args.per_device_train_batch_size
            if mode == "train"
            else self.args.per_device_eval_batch_size,
        )
        return logps

    def _log_mismatch(self, output, mode: str) -> None:
        gen = output["sampling_per_token_logps"]
        train = output.get("old_per_token_logps")
        if train is None:
            train = self._learner_logps(output, mode)
        mask = output["completion_mask"]
        if "tool_mask" in output:
            mask = mask * output["tool_mask"]
        mask = mask.bool() & ~torch.isnan(gen)
        # Masked positions out before any exp: a tool call's output tokens (sampler log-prob 0, learner's real) may
        # be improbable enough that exp|d| overflows, and inf * 0 made the whole step's metric NaN.
        d = torch.where(mask, train - gen, 0.0)
        # The share of tokens whose raw learner/sampler ratio falls outside [clip_min, clip_max]: those the
        # correction truncates or masks (per token, or through their sequence in sequence_* modes).
        log_ratio = d * mask
        if self.vllm_importance_sampling_mode.startswith("sequence"):
            log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(d)
        ratio = torch.exp(log_ratio)
        clip_max = self.vllm_importance_sampling_clip_max
        clip_min = self.vllm_importance_sampling_clip_min
        oob = torch.zeros_like(mask)
        if clip_max is not None:
            oob |= ratio > clip_max
        if clip_min is not None:
            oob |= ratio < clip_min
        # In float64 and through expm1: at end-to-end FP8's mismatch (|d| ~ 2e-5) the k3 term exp(d) - 1 - d ~ d²/2
        # is 1e-10, far below fp32's rounding of exp(d) (6e-8), and exp|d| sits within fp32's step of 1.
        maskd, dd = mask.double(), d.double()
        sums = torch.stack(
            [
                (torch.expm1(dd.abs()) * maskd).sum(),
                ((torch.expm1(dd) - dd) * maskd).sum(),
                (oob.double() * maskd).sum(),
                maskd.sum(),
            ]
        )
        # Sums then one division: exact token means over all ranks, whatever each rank's token count.
        mult_err, gen_kl, oob_count, count = self.accelerator.gather(sums.unsqueeze(0)).sum(0).tolist()
        if count > 0:
            self._metrics[mode]["sampling/token_mult_prob_error"].append(1 + mult_err / count)
            self._metrics[mode]["sampling/gen_kl"].append(gen_kl / count)
            self._metrics[mode]["sampling/is_oob_ratio"].append(oob_count / count)
