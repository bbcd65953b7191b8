"""FP8GRPOTrainer as a drop-in GRPOTrainer: TRL's own test patterns, on a real tiny Llama, a real tokenizer and a
real `datasets.Dataset`, all built in-process."""

import math

import pytest
import torch
from conftest import tiny_grpo_args, tiny_policy
from datasets import Dataset

from trl_fp8 import FP8GRPOConfig, FP8GRPOTrainer, FP8Recipe
from trl_fp8.demo.task import accuracy_reward, make_dataset
from trl_fp8.demo.task import digit_count_reward as digit_reward
from trl_fp8.generation.reference import ReferenceEngine
from trl_fp8.quant import FP8Linear, W8A8Linear, iter_fp8_state, quantize_blockwise


def digit_trainer(tmp_path, tokenizer, **args) -> FP8GRPOTrainer:
    """A fresh tiny policy learning the digit-count reward on 16 prompts, with `tiny_grpo_args(tmp_path, **args)`."""
    return FP8GRPOTrainer(
        model=tiny_policy(tokenizer),
        reward_funcs=digit_reward,
        args=tiny_grpo_args(tmp_path, **args),
        train_dataset=make_dataset(16),
        processing_class=tokenizer,
    )


def train_and_check(trainer):
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert losses and all(torch.isfinite(torch.tensor(losses)))
    for n, p in trainer.model.named_parameters():
        assert not torch.equal(p, before[n]), f"parameter {n} did not change"
    return trainer.state.log_history


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"])
def test_train_loss_types(tmp_path, demo_tokenizer, loss_type):
    trainer = digit_trainer(tmp_path, demo_tokenizer, loss_type=loss_type)
    assert all(isinstance(trainer.model.get_submodule(f"model.layers.{i}.mlp.down_proj"), FP8Linear) for i in (0, 1))
    logs = train_and_check(trainer)
    keys = set().union(*logs)
    for key in ("sampling/token_mult_prob_error", "sampling/gen_kl", "sampling/is_oob_ratio", "fp8/sync_bytes"):
        assert key in keys, key
    # The kernels the learner ran on are in the logs (on CPU, "auto" resolves to the emulated oracle).
    assert trainer.fp8_backend == "emulated" and "fp8/backend/emulated" in keys


def test_train_multiple_iterations(tmp_path, demo_tokenizer):
    trainer = digit_trainer(tmp_path, demo_tokenizer, num_iterations=2, max_steps=3)
    train_and_check(trainer)


def test_train_beta_non_zero_converts_the_reference_model(tmp_path, demo_tokenizer):
    # TRL builds the reference model from the policy's path: save the tiny model locally (no Hub).
    path = tmp_path / "policy"
    tiny_policy(demo_tokenizer).save_pretrained(path)
    demo_tokenizer.save_pretrained(path)
    trainer = FP8GRPOTrainer(
        model=str(path),
        reward_funcs=digit_reward,
        args=tiny_grpo_args(tmp_path / "out", beta=0.1),
        train_dataset=make_dataset(16),
        processing_class=demo_tokenizer,
    )
    assert isinstance(trainer.ref_model.model.layers[0].self_attn.q_proj, FP8Linear)
    logs = train_and_check(trainer)
    assert any("kl" in log for log in logs)


def test_train_with_eval(tmp_path, demo_tokenizer):
    trainer = FP8GRPOTrainer(
        model=tiny_policy(demo_tokenizer),
        reward_funcs=[digit_reward, accuracy_reward],
        args=tiny_grpo_args(tmp_path, eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=4, max_steps=3),
        train_dataset=make_dataset(16),
        eval_dataset=make_dataset(8, seed=1),
        processing_class=demo_tokenizer,
    )
    entries, log = [], trainer.log

    def log_and_count(logs, *args, **kwargs):  # how many sync entries each training log averages
        if "loss" in logs:
            entries.append(len(trainer._metrics["train"]["fp8/sync_seconds"]))
        return log(logs, *args, **kwargs)

    trainer.log = log_and_count
    logs = train_and_check(trainer)
    # One refit per optimizer step, counted once: the training generation after an evaluation's refit adds none.
    assert entries == [1, 1, 1]
    assert len([log for log in logs if "eval_loss" in log]) == 3
    # An evaluation after a step runs the sampler's refit, which still counts for that training step.
    train_logs = [log for log in logs if "loss" in log]
    assert len(train_logs) == 3 and all("fp8/sync_seconds" in log for log in train_logs)
    assert not any("eval_fp8/sync_seconds" in log for log in logs)


def test_train_conversational_prompts(tmp_path, demo_tokenizer):
    demo_tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    data = make_dataset(16)
    dataset = Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": p}] for p in data["prompt"]], "answer": data["answer"]}
    )
    trainer = FP8GRPOTrainer(
        model=tiny_policy(demo_tokenizer),
        reward_funcs=digit_reward,
        args=tiny_grpo_args(tmp_path),
        train_dataset=dataset,
        processing_class=demo_tokenizer,
    )
    train_and_check(trainer)


def test_sampler_holds_the_learners_fp8_weights_bit_for_bit(tmp_path, demo_tokenizer):
    trainer = digit_trainer(tmp_path, demo_tokenizer, max_steps=1)
    trainer.train()  # one optimizer step: the master weights moved
    trainer.vllm_generation.sync_weights()
    sampler = trainer.vllm_generation.sampler
    checked = 0
    for name, module in trainer.model.named_modules():
        if isinstance(module, FP8Linear):
            target = sampler.get_submodule(name)
            assert isinstance(target, W8A8Linear)
            q, s = module.quantized_weight()
            q_ref, s_ref = quantize_blockwise(module.weight.detach(), (128, 128))
            assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), name  # the cache is current
            assert torch.equal(target.weight.view(torch.uint8), q.view(torch.uint8)), name
            assert torch.equal(target.weight_scale_inv, s), name
            checked += 1
    assert checked == 14
    assert torch.equal(sampler.lm_head.weight, trainer.model.lm_head.weight.detach())


@pytest.mark.parametrize("pow2", [False, True], ids=["fp32_scales", "pow2_scales"])
def test_sampler_follows_the_recipes_scale_rule(tmp_path, demo_tokenizer, pow2):
    """With pow2 scales the sampler quantizes activations onto powers of two too, as vLLM does under
    `VLLM_USE_DEEP_GEMM_E8M0=1`, so end-to-end FP8 stays in agreement (token_mult_prob_error 1.02-1.04 here when
    the sampler kept fp32 activation scales, as far apart as an FP8 sampler behind a high-precision learner)."""
    trainer = digit_trainer(tmp_path, demo_tokenizer, fp8_recipe={"pow2_scales": pow2})
    assert all(m.pow2_scales == pow2 for m in trainer.vllm_generation.sampler.modules() if isinstance(m, W8A8Linear))
    trainer.train()
    errors = [log["sampling/token_mult_prob_error"] for log in trainer.state.log_history if "loss" in log]
    assert len(errors) == 2 and max(errors) < 1.005, errors


def test_fp32_model_with_bf16_and_generation_kwargs(tmp_path, demo_tokenizer):
    """TRL loads models in fp32 and `bf16=True` runs the sampler in bf16: the learner's high-precision tensors are
    cast into it at each sync (FP8 codes and scales arrive exactly); `generation_kwargs` override the sampling
    parameters, as in TRL, rather than colliding with them."""
    model = tiny_policy(demo_tokenizer)
    assert model.dtype == torch.float32
    trainer = FP8GRPOTrainer(
        model=model,
        reward_funcs=digit_reward,
        args=tiny_grpo_args(tmp_path, bf16=True, generation_kwargs={"top_k": 5, "max_new_tokens": 3}),
        train_dataset=make_dataset(16),
        processing_class=demo_tokenizer,
    )
    engine = trainer.vllm_generation
    assert (engine.generation_config.top_k, engine.generation_config.max_new_tokens) == (5, 3)
    # Completions are cut where generate() stops, also when generation_kwargs name other stop tokens.
    other_eos = ReferenceEngine(
        trainer.model, trainer.accelerator, FP8Recipe(), fp8=True, dtype=torch.float32, eos_token_ids=[2],
        pad_token_id=0, generation_kwargs={"eos_token_id": 7},
    )  # fmt: skip
    assert other_eos.eos_token_ids == [7]
    train_and_check(trainer)
    engine.sync_weights()
    sampler, learner = engine.sampler, trainer.model
    assert sampler.lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(sampler.lm_head.weight, learner.lm_head.weight.detach().bfloat16())
    down = learner.model.layers[1].mlp.down_proj
    q, s = down.quantized_weight()
    held = sampler.model.layers[1].mlp.down_proj
    assert torch.equal(held.weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(held.weight_scale_inv, s)


def test_importance_sampling_is_applied_to_the_engine_logprobs(tmp_path, demo_tokenizer):
    # FP8 sampler, high-precision learner: a real mismatch. A cap just above 1 makes TRL truncate many tokens.
    clip_max = 1.0005
    trainer = digit_trainer(tmp_path, demo_tokenizer, fp8_training=False, vllm_importance_sampling_clip_max=clip_max)
    batch = [make_dataset(16)[i] for i in range(4)]
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # what Trainer's loop sets before the first step
    inputs = trainer._generate_and_score_completions(batch)
    ratio = inputs["importance_sampling_ratio"]
    raw = torch.exp((inputs["old_per_token_logps"] - inputs["sampling_per_token_logps"]) * inputs["completion_mask"])
    torch.testing.assert_close(ratio, raw.clamp(max=clip_max))
    assert (raw > clip_max).any() and ratio.max() <= clip_max
    assert trainer._metrics["train"]["sampling/is_oob_ratio"][-1] > 0

    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, inputs)
        loss_without_is = trainer.compute_loss(
            trainer.model, {**inputs, "importance_sampling_ratio": torch.ones_like(ratio)}
        )
    assert not torch.isclose(loss, loss_without_is)


def test_engine_logprobs_are_the_samplers_processed_logprobs(tmp_path, demo_tokenizer):
    temperature = 0.7
    trainer = digit_trainer(tmp_path, demo_tokenizer, temperature=temperature, max_completion_length=6)
    engine = trainer.vllm_generation
    engine.sync_weights()
    prompts = [demo_tokenizer(p)["input_ids"] for p in make_dataset(4)["prompt"]]
    prompt_ids, completion_ids, logprobs, _ = engine.generate(prompts, None, 1)
    assert prompt_ids == prompts
    for prompt, completion, lps in zip(prompts, completion_ids, logprobs, strict=True):
        assert len(completion) == len(lps) > 0
        eos = demo_tokenizer.eos_token_id
        assert eos not in completion[:-1]
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logits = engine.sampler(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
        expected = logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor([lp[0] for lp in lps]), expected, atol=1e-4, rtol=1e-4)


def test_failed_sync_leaves_the_sampler_on_its_last_good_weights(tmp_path, demo_tokenizer):
    trainer = digit_trainer(tmp_path, demo_tokenizer)
    engine = trainer.vllm_generation
    engine.sync_weights()
    before = {k: v.clone() for k, v in engine.sampler.state_dict().items()}
    pairs = engine.state_stream()
    pairs = [(n, t * 2 if n.endswith("q_proj.weight_scale_inv") else t) for n, t in pairs]  # valid, would change
    pairs = [p for p in pairs if not p[0].endswith("layers.1.mlp.up_proj.weight_scale_inv")]  # a scale goes missing
    from trl_fp8.quant.export import load_state_stream

    with pytest.raises(ValueError, match=r"missing from the stream: model.layers.1.mlp.up_proj.weight_scale_inv"):
        load_state_stream(engine.sampler, pairs)
    bad_dtype = [
        (n, t.float() if n.endswith("layers.0.self_attn.k_proj.weight") else t) for n, t in engine.state_stream()
    ]
    with pytest.raises(ValueError, match=r"layers.0.self_attn.k_proj.weight: got \(128, 256\) torch.float32"):
        load_state_stream(engine.sampler, bad_dtype)
    twice = engine.state_stream()
    twice.append(("model.norm.weight", torch.full_like(dict(twice)["model.norm.weight"], 7.0)))
    with pytest.raises(ValueError, match=r"model.norm.weight: twice in the stream"):
        load_state_stream(engine.sampler, iter(twice))  # any iterable, checked whole before anything is copied
    # A diverged learner: a NaN in a high-precision weight (FP8 weights are checked where they are quantized).
    with torch.no_grad():
        trainer.model.model.norm.weight[3] = float("nan")
    with pytest.raises(ValueError, match=r"NaN, inf or non-positive scales in \['model.norm.weight'\]; nothing was"):
        engine.sync_weights()
    for k, v in engine.sampler.state_dict().items():
        assert torch.equal(
            v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v,
            before[k].view(torch.uint8) if v.dtype == torch.float8_e4m3fn else before[k],
        ), k
    # An fp16 sampler behind an fp32 learner: a weight past fp16's range would arrive as inf.
    with torch.no_grad():
        trainer.model.model.norm.weight[3] = 1.0
        trainer.model.model.embed_tokens.weight[5, 0] = 1e6
    fp16 = ReferenceEngine(
        trainer.model, trainer.accelerator, trainer.args.resolved_fp8_recipe, fp8=True, dtype=torch.float16,
        eos_token_ids=[demo_tokenizer.eos_token_id], pad_token_id=demo_tokenizer.pad_token_id,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"in \['model.embed_tokens.weight'\]"):
        fp16.sync_weights()


def test_every_generation_samples_with_the_learners_current_weights(tmp_path, demo_tokenizer):
    """Checked at each generation, across two `train()` calls (the second restarts `global_step`)."""
    trainer = digit_trainer(tmp_path, demo_tokenizer, max_steps=1)
    engine, generate, stale = trainer.vllm_generation, trainer.vllm_generation.generate, []

    def generate_and_check(*args, **kwargs):
        held = engine.sampler.state_dict()
        current = [(n, t) for n, t in iter_fp8_state(trainer.model) if n.endswith("_scale_inv")]
        stale.append(sum(not torch.equal(held[n], t) for n, t in current))
        return generate(*args, **kwargs)

    engine.generate = generate_and_check
    trainer.train()
    trainer.train()
    assert stale == [0, 0]


def test_sync_metrics_measure_the_stream_and_mismatch_metrics_switch_off(tmp_path, demo_tokenizer):
    """`fp8/sync_bytes` is what a refit sends, `fp8/sync_bf16_bytes` what the same tensors (scales aside) take in
    BF16; no KV calibration time is logged without an FP8 KV cache; `fp8_mismatch_metrics=False` drops the metrics."""
    trainer = digit_trainer(tmp_path, demo_tokenizer, max_steps=1, fp8_mismatch_metrics=False)
    trainer.train()
    log = next(log for log in trainer.state.log_history if "loss" in log)
    pairs = trainer.vllm_generation.state_stream()
    assert log["fp8/sync_bytes"] == sum(t.numel() * t.element_size() for _, t in pairs)
    assert log["fp8/sync_bf16_bytes"] == sum(2 * t.numel() for name, t in pairs if not name.endswith("_scale_inv"))
    assert "fp8/kv_calibration_seconds" not in log and "sampling/token_mult_prob_error" not in log


def test_mismatch_metrics_without_the_correction_run_the_learner(tmp_path, demo_tokenizer):
    """With the IS correction off TRL computes no learner log-probs for the batch; the metrics then run the learner
    themselves, so an FP8 sampler behind a high-precision learner still shows its mismatch."""
    trainer = digit_trainer(
        tmp_path, demo_tokenizer, max_steps=1, fp8_training=False, vllm_importance_sampling_correction=False
    )
    trainer.train()
    log = next(log for log in trainer.state.log_history if "loss" in log)
    assert log["sampling/token_mult_prob_error"] > 1.0 and log["sampling/gen_kl"] > 0.0


def test_the_engine_refits_only_when_the_learner_changed(tmp_path, demo_tokenizer):
    trainer = digit_trainer(tmp_path, demo_tokenizer)
    engine = trainer.vllm_generation
    engine.sync_weights()
    engine.last_sync = None
    engine.sync_weights()  # the same weights: no refit, no KV recalibration
    assert engine.last_sync is None
    with torch.no_grad():
        trainer.model.model.norm.weight.add_(0.1)
    engine.sync_weights()
    assert engine.last_sync is not None
    assert torch.equal(engine.sampler.model.norm.weight, trainer.model.model.norm.weight)


def test_completions_keep_their_stop_token(tmp_path, demo_tokenizer):
    """TRL reads a completion without its stop token as truncated (and masks it under `mask_truncated_completions`):
    the engine cuts after the stop token, not before. Here every token stops, so each completion is one token."""
    trainer = digit_trainer(tmp_path, demo_tokenizer)
    everything = list(range(trainer.model.config.vocab_size))
    engine = ReferenceEngine(
        trainer.model, trainer.accelerator, FP8Recipe(), fp8=True, dtype=torch.float32, eos_token_ids=everything,
        pad_token_id=demo_tokenizer.pad_token_id, max_completion_length=4,
    )  # fmt: skip
    engine.sync_weights()
    _, completions, logprobs, _ = engine.generate([[5, 6, 7]] * 3)
    assert [len(c) for c in completions] == [1, 1, 1] and [len(lp) for lp in logprobs] == [1, 1, 1]


def test_mismatch_metrics_are_the_formulas_nemo_rl_and_verl_log(tmp_path, demo_tokenizer):
    """token_mult_prob_error = mean exp|d|, gen_kl = mean (exp(d) - 1 - d) (k3), is_oob_ratio = share of masked tokens
    whose ratio exp(d) leaves [clip_min, clip_max] (through their sequence's summed log-ratio in sequence modes),
    with d = logp_train - logp_gen over the completion mask."""
    trainer = digit_trainer(tmp_path, demo_tokenizer)
    d = torch.tensor([[0.8, -0.1, -0.1], [0.5, 0.5, 3.0]])  # exp(0.8) > 2 alone; row 2 sums to 1.0 over its mask
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    gen = torch.full_like(d, -2.0)
    output = {"sampling_per_token_logps": gen, "old_per_token_logps": gen + d, "completion_mask": mask}
    live = d[mask.bool()]
    for mode, oob in (("token_truncate", 1 / 5), ("sequence_mask", 2 / 5)):
        trainer.vllm_importance_sampling_mode = mode
        trainer._metrics["train"].clear()
        trainer._log_mismatch(output, "train")
        metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
        assert metrics["sampling/token_mult_prob_error"] == pytest.approx(live.abs().exp().mean().item())
        assert metrics["sampling/gen_kl"] == pytest.approx((live.exp() - 1 - live).mean().item())
        assert metrics["sampling/is_oob_ratio"] == pytest.approx(oob), mode

    def metrics_of(d, mask, mode="token_truncate", clip_min=None, gen=None, **extra):
        trainer.vllm_importance_sampling_mode, trainer.vllm_importance_sampling_clip_min = mode, clip_min
        gen = torch.full_like(d, -2.0) if gen is None else gen
        trainer._metrics["train"].clear()
        trainer._log_mismatch(
            {"sampling_per_token_logps": gen, "old_per_token_logps": gen + d, "completion_mask": mask, **extra},
            "train",
        )
        return {k: v[-1] for k, v in trainer._metrics["train"].items()}

    # A masked token never enters its sequence's log-ratio (0.6 here; with the masked 3.0 it would leave the cap).
    assert (
        metrics_of(torch.tensor([[0.3, 0.3, 3.0]]), torch.tensor([[1, 1, 0]]), "sequence_mask")[
            "sampling/is_oob_ratio"
        ]
        == 0
    )
    # The lower cap counts too: exp(-1) < 0.5.
    assert metrics_of(torch.tensor([[-1.0, 0.0]]), torch.tensor([[1, 1]]), clip_min=0.5)[
        "sampling/is_oob_ratio"
    ] == pytest.approx(0.5)
    # Tool-call tokens are out, whether TRL marks them with a NaN sampler log-prob or with its `tool_mask`.
    nan_gen = torch.tensor([[-2.0, float("nan")]])
    with_nan = metrics_of(torch.tensor([[1.0, 0.0]]), torch.tensor([[1, 1]]), gen=nan_gen)
    assert with_nan["sampling/token_mult_prob_error"] == pytest.approx(math.e)
    tool = metrics_of(torch.tensor([[0.0, 1.0]]), torch.tensor([[1, 1]]), tool_mask=torch.tensor([[1, 0]]))
    assert tool["sampling/token_mult_prob_error"] == 1.0


def test_config_defaults_and_contradictions(tmp_path):
    args = FP8GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False)
    assert args.vllm_importance_sampling_mode == "token_truncate"
    assert args.vllm_importance_sampling_clip_max == 2.0
    assert args.resolved_fp8_recipe == FP8Recipe()
    assert FP8GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, fp8_recipe='{"pow2_scales": true}'
    ).resolved_fp8_recipe.pow2_scales
    with pytest.raises(ValueError, match="vllm_mode='server' is not supported"):
        FP8GRPOConfig(output_dir=str(tmp_path), use_cpu=True, use_vllm=True, vllm_mode="server")
    with pytest.raises(ValueError, match="use_transformers_continuous_batching"):
        FP8GRPOConfig(output_dir=str(tmp_path), use_cpu=True, use_transformers_continuous_batching=True)
    with pytest.raises(ValueError, match="loss_type='vespo' needs vllm_importance_sampling_mode"):
        FP8GRPOConfig(
            output_dir=str(tmp_path), use_cpu=True, loss_type="vespo", vllm_importance_sampling_mode="sequence_mask"
        )
    with pytest.raises(ValueError, match=r"fp8_recipe: unknown FP8Recipe fields \['blocks'\]"):
        FP8GRPOConfig(output_dir=str(tmp_path), use_cpu=True, fp8_recipe={"blocks": 3})
    with pytest.raises(ValueError, match=r"generation_kwargs\['num_return_sequences'\] is set by .*num_generations"):
        FP8GRPOConfig(output_dir=str(tmp_path), use_cpu=True, generation_kwargs={"num_return_sequences": 2})
    with pytest.raises(ValueError, match=r"fp8_recipe: expected an FP8Recipe, a dict .* got int 123"):
        FP8GRPOConfig(output_dir=str(tmp_path), use_cpu=True, fp8_recipe=123)
    # The samplers take 128x128 blocks only: refused here, not at the first weight sync after loading everything.
    blocks = {"weight_block_size": [64, 64], "backend": "emulated"}
    with pytest.raises(ValueError, match=r"weight_block_size \[64, 64\] needs fp8_generation=False"):
        FP8GRPOConfig(output_dir=str(tmp_path), use_cpu=True, fp8_recipe=blocks)
    assert FP8GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, fp8_recipe=blocks, fp8_generation=False
    ).resolved_fp8_recipe.weight_block_size == [64, 64]
    for field, value, message in (
        ("fp8_save_format", "fp16", "fp8_save_format must be 'bf16' or 'fp8', got 'fp16'"),
        ("fp8_kv_scale_margin", 0.0, "fp8_kv_scale_margin must be positive"),
        ("fp8_kv_scale_percentile", 0.0, r"fp8_kv_scale_percentile must be in \(0, 100\]"),
        ("fp8_kv_calibration_rows", 0, "fp8_kv_calibration_rows must be at least 1"),
    ):
        with pytest.raises(ValueError, match=message):
            FP8GRPOConfig(output_dir=str(tmp_path), use_cpu=True, **{field: value})
    # The edges that are allowed: the KV scale at the calibration's plain maximum, vespo with per-token masking, and
    # vespo with a sequence mode while the correction that mode names is off.
    FP8GRPOConfig(output_dir=str(tmp_path), use_cpu=True, fp8_kv_scale_percentile=100)
    FP8GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, loss_type="vespo", vllm_importance_sampling_mode="token_mask"
    )
    FP8GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, loss_type="vespo", vllm_importance_sampling_mode="sequence_mask",
        vllm_importance_sampling_correction=False,
    )  # fmt: skip


@pytest.mark.parametrize("backend", ["torch", "te"])
def test_a_backend_that_cannot_run_here_is_refused_before_anything_changes(tmp_path, demo_tokenizer, backend):
    """CPU training with backend='torch' (needs an SM90 GPU) or 'te': refused before GRPOTrainer loads anything or
    the user's model is converted."""
    model = tiny_policy(demo_tokenizer)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    args = tiny_grpo_args(tmp_path, fp8_recipe={"backend": backend})
    with pytest.raises(RuntimeError, match=f"FP8 backend '{backend}' cannot run here"):
        FP8GRPOTrainer(
            model=model, reward_funcs=digit_reward, args=args, train_dataset=make_dataset(8),
            processing_class=demo_tokenizer,
        )  # fmt: skip
    assert not any(type(m).__name__ == "FP8Linear" for m in model.modules()) and not hasattr(model, "fp8_recipe")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_sharded_parameters_are_refused_at_start(tmp_path, demo_tokenizer, monkeypatch):
    """FSDP (from TrainingArguments or `accelerate launch`'s environment): refused before GRPOTrainer builds anything,
    naming what works instead. (ZeRO-3 takes the same path through transformers' `is_deepspeed_zero3_enabled`, but
    needs deepspeed, which this project does not install.)"""
    kwargs = dict(reward_funcs=digit_reward, train_dataset=make_dataset(8), processing_class=demo_tokenizer)
    with pytest.raises(NotImplementedError, match=r"does not support FSDP yet.*ZeRO-2"):
        FP8GRPOTrainer(model=tiny_policy(demo_tokenizer), args=tiny_grpo_args(tmp_path, fsdp="full_shard"), **kwargs)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(NotImplementedError, match=r"does not support FSDP yet"):
        FP8GRPOTrainer(model=tiny_policy(demo_tokenizer), args=tiny_grpo_args(tmp_path), **kwargs)


def test_rejects_a_plain_grpo_config(tmp_path, demo_tokenizer):
    from trl import GRPOConfig

    with pytest.raises(TypeError, match=r"replace GRPOConfig\(...\) by FP8GRPOConfig"):
        FP8GRPOTrainer(
            model=tiny_policy(demo_tokenizer),
            reward_funcs=digit_reward,
            args=GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none"),
            train_dataset=make_dataset(8),
            processing_class=demo_tokenizer,
        )


def test_peft_is_refused_with_a_clear_error(tmp_path, demo_tokenizer):
    from peft import LoraConfig

    with pytest.raises(NotImplementedError, match="does not support PEFT"):
        FP8GRPOTrainer(
            model=tiny_policy(demo_tokenizer),
            reward_funcs=digit_reward,
            args=tiny_grpo_args(tmp_path),
            train_dataset=make_dataset(8),
            processing_class=demo_tokenizer,
            peft_config=LoraConfig(target_modules=["q_proj"]),
        )


def test_rollout_func_samples_with_the_learners_current_fp8_weights(tmp_path, demo_tokenizer, monkeypatch):
    """TRL's experimental `rollout_func` replaces TRL's generation call, not its refit: TRL still syncs the engine in
    its slot before every rollout, so a rollout that samples through `trainer.vllm_generation` samples in FP8 with
    the learner's current weights, and the IS correction and the mismatch metrics see its log-probs."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    stale = []

    def rollout(prompts, trainer):
        engine = trainer.vllm_generation
        held = engine.sampler.state_dict()
        current = [(n, t) for n, t in iter_fp8_state(trainer.model) if n.endswith("_scale_inv")]
        stale.append(sum(not torch.equal(held[n], t) for n, t in current))
        prompt_ids = [trainer.processing_class(p)["input_ids"] for p in prompts]
        _, completion_ids, logprobs, _ = engine.generate(prompt_ids, None, trainer.num_generations)
        logprobs = [[lp[0] for lp in seq] for seq in logprobs]
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}

    trainer = FP8GRPOTrainer(
        model=tiny_policy(demo_tokenizer),
        reward_funcs=digit_reward,
        args=tiny_grpo_args(tmp_path, max_steps=3),
        train_dataset=make_dataset(16),
        processing_class=demo_tokenizer,
        rollout_func=rollout,
    )
    logs = train_and_check(trainer)
    assert stale == [0, 0, 0]
    steps = [log for log in logs if "loss" in log]
    # The learner scores the rollout's tokens on the sampler's own FP8 grid: log-probs that were not the engine's
    # (or were sampled on stale weights) would show here.
    assert all(log["fp8/sync_bytes"] > 0 and 1.0 <= log["sampling/token_mult_prob_error"] < 1.01 for log in steps)
