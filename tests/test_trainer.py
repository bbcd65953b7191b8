"""FP8GRPOTrainer as a drop-in GRPOTrainer: TRL's own test patterns, on a real tiny Llama, a real tokenizer and a
real `datasets.Dataset`, all built in-process. The sampling engine's side of it: tests/test_reference_engine.py; what
the trainer refuses: tests/test_trainer_refusals.py."""

import logging
import math

import pytest
import torch
from conftest import digit_trainer, tiny_grpo_args, tiny_policy, train_and_check
from datasets import Dataset

from trl_fp8 import FP8GRPOTrainer, FP8Recipe
from trl_fp8.demo.task import accuracy_reward, make_dataset
from trl_fp8.demo.task import digit_count_reward as digit_reward
from trl_fp8.quant import FP8Linear, iter_fp8_state
from trl_fp8.trainers.checks import warn_emulated_on_gpu


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


def test_a_gpu_left_to_the_emulated_oracle_is_warned_of(tmp_path, demo_tokenizer, caplog):
    """`auto` on a GPU without FP8 GEMMs (Ampere, Ada) trains on `emulated`, slower than BF16: the start-up warning
    says so and why each fast backend cannot run. No such GPU is here, so the check is given the CUDA device the
    trainer would see (it reads only the device's type and what each backend says of it); on the CPU, the reference
    path everywhere, and when `emulated` is asked for by name, nothing is warned of."""
    cuda = torch.device("cuda", 0)
    with caplog.at_level(logging.WARNING, logger="trl_fp8"):
        warn_emulated_on_gpu("emulated", FP8Recipe(), cuda)
    (message,) = [r.getMessage() for r in caplog.records]
    assert "on cuda:0 runs on the 'emulated' backend" in message and "slower than BF16" in message
    assert all(f"{name}: " in message for name in ("torch", "triton", "te"))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trl_fp8"):
        warn_emulated_on_gpu("emulated", FP8Recipe(weight_block_size=(64, 128)), cuda)
    assert "weight_block_size=[64, 128]: the fast GEMMs take 128x128 weight blocks only" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trl_fp8"):
        warn_emulated_on_gpu("emulated", FP8Recipe(backend="emulated"), cuda)
        warn_emulated_on_gpu("torch", FP8Recipe(), cuda)
        trainer = digit_trainer(tmp_path, demo_tokenizer)
    assert trainer.fp8_backend == "emulated" and "'emulated' backend" not in caplog.text


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
    # The evaluation after the last step refits the sampler too, and no training log follows: logged on its own.
    assert [log["step"] for log in logs if "fp8/sync_seconds" in log] == [1, 2, 3, 3]
    assert not trainer._metrics["train"]["fp8/sync_seconds"]


def test_an_evaluation_outside_training_logs_its_refit(tmp_path, demo_tokenizer):
    trainer = FP8GRPOTrainer(
        model=tiny_policy(demo_tokenizer),
        reward_funcs=digit_reward,
        args=tiny_grpo_args(tmp_path, per_device_eval_batch_size=4, max_steps=1),
        train_dataset=make_dataset(16),
        eval_dataset=make_dataset(8, seed=1),
        processing_class=demo_tokenizer,
    )
    trainer.train()  # refits before its one step's generation, not after the step
    seen = len(trainer.state.log_history)
    trainer.evaluate()
    synced = [log for log in trainer.state.log_history[seen:] if "fp8/sync_seconds" in log]
    assert len(synced) == 1 and synced[0]["fp8/sync_bytes"] > 0 and not trainer._metrics["train"]["fp8/sync_seconds"]
    trainer.evaluate()  # the learner has not changed since: no refit, nothing to log
    assert not any("fp8/sync_seconds" in log for log in trainer.state.log_history[seen + len(synced) + 1 :])


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
    themselves, so an FP8 sampler behind a high-precision learner still shows its mismatch, in training and in
    evaluation, in chunks of the mode's batch size as TRL's own forwards."""
    trainer = digit_trainer(
        tmp_path, demo_tokenizer, max_steps=1, fp8_training=False, vllm_importance_sampling_correction=False,
        per_device_eval_batch_size=8,
    )  # fmt: skip
    chunks, forward = [], trainer._get_per_token_logps_and_entropies

    def recorded(*args, batch_size=None, **kwargs):
        chunks.append((trainer.model.training, batch_size))
        return forward(*args, batch_size=batch_size, **kwargs)

    trainer._get_per_token_logps_and_entropies = recorded
    trainer.train()
    log = next(log for log in trainer.state.log_history if "loss" in log)
    assert log["sampling/token_mult_prob_error"] > 1.0 and log["sampling/gen_kl"] > 0.0
    chunks.clear()
    metrics = trainer.evaluate(make_dataset(8, seed=1))
    assert metrics["eval_sampling/token_mult_prob_error"] > 1.0
    assert trainer.args.per_device_train_batch_size == 4 and (False, 8) in chunks and (False, 4) not in chunks


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
    # ...even one the policy finds improbable (its learner log-prob -95, the sampler's TRL's 0): exp|d| overflowed
    # there, and inf * 0 made the step's metric NaN.
    improbable = metrics_of(
        torch.tensor([[0.01, -95.0]]),
        torch.tensor([[1, 1]]),
        gen=torch.tensor([[-1.0, 0.0]]),
        tool_mask=torch.tensor([[1, 0]]),
    )
    assert improbable["sampling/token_mult_prob_error"] == pytest.approx(math.exp(0.01), rel=1e-6)
    # At end-to-end FP8's mismatch, |d| ~ 2e-5: k3 ~ d²/2 ~ 2e-10, under fp32's rounding of exp(d) (6e-8). The
    # figures are those of the float64 formulas on the same d.
    tiny = torch.tensor([[2e-5, -3e-5, 1e-5, -2e-5]])
    d64 = ((torch.full_like(tiny, -2.0) + tiny) - torch.full_like(tiny, -2.0)).double()  # d as the fp32 inputs give it
    small = metrics_of(tiny, torch.ones_like(tiny, dtype=torch.long))
    assert small["sampling/gen_kl"] == pytest.approx((torch.expm1(d64) - d64).mean().item(), rel=1e-9)
    assert small["sampling/token_mult_prob_error"] == pytest.approx(
        1 + torch.expm1(d64.abs()).mean().item(), rel=1e-15
    )


@pytest.mark.parametrize("mode", ["sequence_truncate", "sequence_mask"])
def test_is_oob_ratio_counts_whole_sequences_in_every_sequence_mode(tmp_path, demo_tokenizer, mode):
    """`sampling/is_oob_ratio` in both sequence modes: TRL's `sequence_truncate`, like `sequence_mask`, compares each
    sequence's summed log-ratio with the caps, so every token of a sequence outside them counts as out of bounds."""
    trainer = digit_trainer(tmp_path, demo_tokenizer)
    # Row 1: no token alone leaves the cap 2.0 (exp 0.5 < 2), but the sequence does (exp 1.0 > 2): both its tokens.
    # Row 0: exp(0.8) > 2 alone, but its sequence sums to 0.6: none of its tokens.
    d = torch.tensor([[0.8, -0.1, -0.1], [0.5, 0.5, 3.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    gen = torch.full_like(d, -2.0)
    trainer.vllm_importance_sampling_mode = mode
    trainer._metrics["train"].clear()
    trainer._log_mismatch(
        {"sampling_per_token_logps": gen, "old_per_token_logps": gen + d, "completion_mask": mask}, "train"
    )
    assert trainer._metrics["train"]["sampling/is_oob_ratio"][-1] == pytest.approx(2 / 5)


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


def test_a_rollout_func_without_the_samplers_logprobs_is_refused_by_name(tmp_path, demo_tokenizer, monkeypatch):
    """The correction needs the sampler's log-probs; a rollout without them is told so (TRL itself, which skips the
    correction without vLLM, would fail on them with a bare TypeError), and runs with the correction off."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")

    def rollout(prompts, trainer):
        prompt_ids = [trainer.processing_class(p)["input_ids"] for p in prompts]
        return {"prompt_ids": prompt_ids, "completion_ids": [[5, 6, 2]] * len(prompts), "logprobs": None}

    def build(**args):
        return FP8GRPOTrainer(
            model=tiny_policy(demo_tokenizer),
            reward_funcs=digit_reward,
            args=tiny_grpo_args(tmp_path, max_steps=1, **args),
            train_dataset=make_dataset(16),
            processing_class=demo_tokenizer,
            rollout_func=rollout,
        )

    with pytest.raises(
        ValueError, match=r"rollout_func returned no 'logprobs': with vllm_importance_sampling_correction=True"
    ):
        build().train()
    assert build(vllm_importance_sampling_correction=False).train().global_step == 1
