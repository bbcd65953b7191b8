"""Drop-in means every GRPOConfig option a user may already have set keeps working: under each, FP8GRPOTrainer trains
(finite losses, every parameter moves), logs its mismatch metrics, and leaves the sampler holding the learner's FP8
weights bit for bit. Options with dedicated tests elsewhere (loss types, num_iterations, beta, evaluation,
conversational prompts, bf16, the KV cache, checkpoints) are not repeated here."""

import logging

import pytest
import torch
from conftest import digit_trainer, holds_its_own_fp8_weight, tiny_grpo_args, tiny_policy, train_and_check
from peft import LoraConfig
from torch import nn
from transformers import LlamaConfig, LlamaForSequenceClassification

from trl_fp8 import FP8GRPOConfig, FP8GRPOTrainer
from trl_fp8.demo.families import varied_reward
from trl_fp8.demo.task import DEMO_MODEL_DIR, accuracy_reward, digit_count_reward, make_dataset
from trl_fp8.quant import FP8Linear
from trl_fp8.quant.lora import FP8LoraLinear
from trl_fp8.trainers.checks import warn_truncated_sampling


OPTIONS = {
    "steps_per_generation": dict(steps_per_generation=2, max_steps=3),
    "gradient_accumulation": dict(gradient_accumulation_steps=2),
    "scale_rewards_batch": dict(scale_rewards="batch"),
    "scale_rewards_none": dict(scale_rewards="none"),
    "top_entropy_quantile": dict(top_entropy_quantile=0.2),
    "adaptive_entropy_bonus": dict(use_adaptive_entropy=True, entropy_coef=0.01),
    "two_sided_clipping": dict(delta=1.5, epsilon_high=0.28),
    "gspo_sequence_level": dict(importance_sampling_level="sequence"),
    "is_sequence_truncate": dict(vllm_importance_sampling_mode="sequence_truncate"),
    "is_token_mask": dict(vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_min=0.5),
    "is_sequence_mask": dict(vllm_importance_sampling_mode="sequence_mask"),
    "off_policy_mask": dict(off_policy_mask_threshold=0.5),
    "weighted_rewards": dict(reward_weights=[1.0, 0.5], multi_objective_aggregation="normalize_then_sum"),
    "log_completions": dict(log_completions=True, num_completions_to_print=2, log_unique_prompts=True),
    "pad_to_multiple_of": dict(pad_to_multiple_of=64),
    "gradient_checkpointing": dict(gradient_checkpointing=True, disable_dropout=True),
    "cosine_schedule_sgd": dict(lr_scheduler_type="cosine", optim="sgd"),
    "entropy_bonus": dict(entropy_coef=0.01),
    "generation_batch_size": dict(generation_batch_size=8),
    "no_shuffle": dict(shuffle_dataset=False),
    # FP8 + LoRA under the options that touch it most: recomputation, reused generations, several iterations.
    "lora_gradient_checkpointing": dict(gradient_checkpointing=True, lora=True),
    "lora_steps_per_generation": dict(steps_per_generation=2, max_steps=3, num_iterations=2, lora=True),
}


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_trains_in_fp8_under_trl_option(tmp_path, demo_tokenizer, options):
    options = dict(options)
    lora = LoraConfig(target_modules="all-linear", lora_dropout=0.0) if options.pop("lora", False) else None
    rewards = [digit_count_reward, accuracy_reward] if "reward_weights" in options else digit_count_reward
    trainer = FP8GRPOTrainer(
        model=tiny_policy(demo_tokenizer),
        reward_funcs=rewards,
        args=tiny_grpo_args(tmp_path, **options),
        train_dataset=make_dataset(16),
        processing_class=demo_tokenizer,
        peft_config=lora,
    )
    if lora is None:
        logs = train_and_check(trainer)
    else:  # only the adapters train
        trainer.train()
        logs = trainer.state.log_history
    errors = [log["sampling/token_mult_prob_error"] for log in logs if "sampling/token_mult_prob_error" in log]
    assert errors and max(errors) < 1.01, errors  # end-to-end FP8: sampler and learner on one weight grid
    engine = trainer.vllm_generation
    engine.sync_weights()
    learner = engine.learner()  # without the PEFT wrapper: the checkpoint's names
    linears = [(n, m) for n, m in learner.named_modules() if isinstance(m, FP8LoraLinear if lora else FP8Linear)]
    assert len(linears) == 14
    for name, module in linears:
        q, s = module.quantized_weight()
        held = engine.sampler.get_submodule(name)
        assert torch.equal(held.weight.view(torch.uint8), q.view(torch.uint8)), name
        assert torch.equal(held.weight_scale_inv, s), name


def test_a_reward_model_scores_in_high_precision_and_is_left_untouched(tmp_path, demo_tokenizer):
    """A sequence classifier as reward function (TRL prepares it for evaluation): only the policy converts to FP8; the
    reward model keeps its nn.Linear layers and its weights while the policy trains."""
    torch.manual_seed(1)
    config = LlamaConfig(
        vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=64, num_labels=1, pad_token_id=demo_tokenizer.pad_token_id,
    )  # fmt: skip
    reward_model = LlamaForSequenceClassification(config)
    before = {n: p.detach().clone() for n, p in reward_model.named_parameters()}
    trainer = FP8GRPOTrainer(
        model=tiny_policy(demo_tokenizer),
        reward_funcs=reward_model,
        args=tiny_grpo_args(tmp_path),
        train_dataset=make_dataset(16),
        processing_class=demo_tokenizer,
        reward_processing_classes=demo_tokenizer,
    )
    logs = train_and_check(trainer)
    assert any(isinstance(m, FP8Linear) for m in trainer.model.modules())
    scorer = trainer.reward_funcs[0]
    assert not any(isinstance(m, FP8Linear) for m in scorer.modules())
    assert sum(isinstance(m, nn.Linear) for m in scorer.modules()) == 8  # 7 in the layer, and the score head
    for name, param in scorer.named_parameters():
        assert torch.equal(param, before[name]), name
    assert all(log["reward"] != 0 for log in logs if "reward" in log)  # the classifier's scores, not a stub's


def test_sync_ref_model_mixes_into_the_reference_models_fp8_weights(tmp_path):
    """TRL's `sync_ref_model` mixes the policy into the reference model after optimizer steps, writing through
    `.data` (no version counter moves): every forward of the reference model must still quantize the weights it
    holds then. Checked at each of its FP8 layers' forwards, against `quantize_blockwise` of its master weight."""
    args = tiny_grpo_args(tmp_path, beta=0.04, sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5,
                          max_steps=3, learning_rate=1e-3)  # fmt: skip
    trainer = FP8GRPOTrainer(
        str(DEMO_MODEL_DIR), reward_funcs=varied_reward, args=args, train_dataset=make_dataset(16)
    )  # a model id: TRL loads the reference model from it
    checked = []

    def holds_its_own_weights(module, args):
        checked.append(holds_its_own_fp8_weight(module))

    ref_layers = [m for m in trainer.ref_model.modules() if isinstance(m, FP8Linear)]
    for layer in ref_layers:
        layer.register_forward_pre_hook(holds_its_own_weights)
    before = [layer.weight.detach().clone() for layer in ref_layers]
    logs = train_and_check(trainer)
    assert len(checked) == 3 * len(ref_layers) and all(checked), checked.count(False)
    assert all(not torch.equal(layer.weight, w) for layer, w in zip(ref_layers, before, strict=True))  # mixed in
    assert [log["kl"] for log in logs if "kl" in log][1:] != [0.0, 0.0]


@pytest.mark.parametrize(
    "options,said",
    [
        (dict(top_k=20), "top_k=20"),
        (dict(top_p=0.9, generation_kwargs={"top_k": 5}), "top_k=5, top_p=0.9"),
        (dict(repetition_penalty=1.2), "repetition_penalty=1.2"),
        (dict(generation_kwargs={"no_repeat_ngram_size": 1}), "generation_kwargs['no_repeat_ngram_size']=1"),
        (dict(generation_kwargs={"suppress_tokens": [2]}), "generation_kwargs['suppress_tokens']=[2]"),
        (dict(), None),
        (dict(generation_kwargs={"no_repeat_ngram_size": 0, "suppress_tokens": []}), None),  # both switched off
        (dict(top_k=20, vllm_importance_sampling_correction=False), None),  # no correction: nothing scales down
    ],
    ids=[
        "top_k", "generation_kwargs", "repetition_penalty", "no_repeat_ngram", "suppress_tokens", "full_distribution",
        "processors_off", "no_correction",
    ],
)  # fmt: skip
def test_truncated_sampling_is_pointed_out_at_start(tmp_path, demo_tokenizer, caplog, options, said):
    with caplog.at_level(logging.WARNING, logger="trl_fp8"):
        trainer = digit_trainer(tmp_path, demo_tokenizer, max_steps=1, **options)
    warned = [r.getMessage() for r in caplog.records if "sampling is truncated or penalized" in r.getMessage()]
    assert warned == ([] if said is None else [warned[0]]) and (said is None or f"({said})" in warned[0])
    assert not any("applies to vLLM only" in r.getMessage() for r in caplog.records)
    if said == "top_k=20":  # what the warning says: the sampler's log-probs exceed the learner's
        trainer.train()
        ratio = trainer.state.log_history[0]["sampling/importance_sampling_ratio/mean"]
        assert ratio < 0.5, ratio  # 0.25 at seed 0: the top 20 of 128 hold about a quarter of a random policy's mass


def test_a_sampling_temperature_other_than_the_learners_is_pointed_out(tmp_path, caplog):
    """`generation_kwargs['temperature']` reaches the sampler only; the learner's log-probs use `temperature`."""
    with caplog.at_level(logging.WARNING, logger="trl_fp8"):
        warn_truncated_sampling(tiny_grpo_args(tmp_path, temperature=0.7, generation_kwargs={"temperature": 0.7}))
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger="trl_fp8"):
        warn_truncated_sampling(tiny_grpo_args(tmp_path, generation_kwargs={"temperature": 0.7}))
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "generation_kwargs['temperature']=0.7 samples at another temperature" in said[0], said
    assert "(temperature=1.0)" in said[0]


def test_use_transformers_paged_is_refused_by_its_own_name(tmp_path):
    """TRL's deprecated `use_transformers_paged` sets `use_transformers_continuous_batching`: the refusal names the
    flag the user set (setting the other to False would change nothing)."""
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match="^use_transformers_paged=True conflicts"):
        FP8GRPOConfig(output_dir=str(tmp_path), use_cpu=True, use_transformers_paged=True)
    with pytest.raises(ValueError, match="^use_transformers_continuous_batching=True conflicts"):
        FP8GRPOConfig(output_dir=str(tmp_path), use_cpu=True, use_transformers_continuous_batching=True)


@pytest.mark.parametrize("use_vllm", [True, False], ids=["vllm", "reference_engine"])
def test_structured_outputs_are_pointed_out_at_start(tmp_path, caplog, use_vllm):
    """vLLM masks the logits with the regex's grammar before computing any log-probs (as for top_k, the ratios then
    run below 1); the reference engine, like TRL's transformers path, samples without the regex. Only the config is
    needed: vLLM cannot run here."""
    args = tiny_grpo_args(tmp_path, use_vllm=use_vllm, vllm_structured_outputs_regex=r"\d+")
    with caplog.at_level(logging.WARNING, logger="trl_fp8"):
        warn_truncated_sampling(args)
    said = [r.getMessage() for r in caplog.records]
    if use_vllm:
        assert len(said) == 1 and "truncated or penalized (vllm_structured_outputs_regex='\\\\d+')" in said[0], said
    else:
        assert len(said) == 1 and "vllm_structured_outputs_regex='\\\\d+' applies to vLLM only" in said[0], said

    # The same constraint through TRL's other door, vLLM's own `structured_outputs` sampling parameter.
    caplog.clear()
    args = tiny_grpo_args(tmp_path, use_vllm=True, generation_kwargs={"structured_outputs": {"regex": "[0-9]+"}})
    with caplog.at_level(logging.WARNING, logger="trl_fp8"):
        warn_truncated_sampling(args)
    assert "truncated or penalized (generation_kwargs['structured_outputs'])" in caplog.records[0].getMessage()
