"""The FP8 KV cache of the reference sampler and its per-step K/V scale recalibration, on the shipped demo model."""

import warnings

import pytest
import torch
from accelerate import Accelerator
from conftest import tiny_grpo_args
from transformers import DynamicCache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from trl_fp8 import FP8GRPOTrainer, FP8Recipe
from trl_fp8.demo.families import available, tiny
from trl_fp8.demo.task import accuracy_reward, load_demo_model_and_tokenizer, make_dataset
from trl_fp8.generation.reference import ReferenceEngine, left_pad
from trl_fp8.quant.export import load_state_stream
from trl_fp8.quant.kv_cache import (
    CACHE_KWARG,
    FP8KVCache,
    _recording_queries,
    calibrate_kv_scales,
    kv_scale_inv_from_amax,
    quantize_kv,
)


def demo_prompts(tokenizer, n=16, seed=0):
    return [tokenizer(p)["input_ids"] for p in make_dataset(n, seed=seed)["prompt"]]


def cache_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def test_fp8_kv_cache_takes_half_the_memory_of_bf16():
    model, tokenizer = load_demo_model_and_tokenizer(dtype=torch.bfloat16)
    ids, mask = left_pad(demo_prompts(tokenizer), tokenizer.pad_token_id)
    bf16, fp8 = DynamicCache(), FP8KVCache([(0.03, 0.02)] * 2)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=True, **{CACHE_KWARG: bf16})
        model(input_ids=ids, attention_mask=mask, use_cache=True, **{CACHE_KWARG: fp8})
    assert bf16.layers[0].keys.dtype == torch.bfloat16 and fp8.layers[0].keys.dtype == torch.float8_e4m3fn
    assert cache_bytes(fp8) * 2 == cache_bytes(bf16)


def test_fp8_kv_layer_stores_e4m3_and_returns_its_dequantization():
    cache = FP8KVCache([(0.01, 0.02)])
    k, v = 10 * torch.randn(2, 2, 5, 64), torch.randn(2, 2, 5, 64)  # k reaches past 448 * 0.01: it must saturate
    k_out, v_out = cache.update(k, v, 0)
    layer = cache.layers[0]
    assert torch.equal(layer.keys.view(torch.uint8), quantize_kv(k, 0.01).view(torch.uint8))
    assert torch.equal(k_out, layer.keys.float() * 0.01) and torch.equal(v_out, layer.values.float() * 0.02)
    beyond = k.abs() > 448 * 0.01
    assert beyond.any() and torch.equal(k_out[beyond].abs(), torch.full_like(k_out[beyond], 448 * 0.01))
    k_out, _ = cache.update(k[:, :, :1], v[:, :, :1], 0)
    assert k_out.shape[-2] == 6 and cache.get_seq_length() == 6


def test_scales_follow_the_weights():
    model, tokenizer = load_demo_model_and_tokenizer()
    ids, mask = left_pad(demo_prompts(tokenizer), tokenizer.pad_token_id)
    before = calibrate_kv_scales(model.get_decoder(), ids, mask)
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.mul_(2)  # RoPE is linear: K doubles, V does not move
    after = calibrate_kv_scales(model.get_decoder(), ids, mask)
    torch.testing.assert_close(after[0, 0], 2 * before[0, 0], rtol=1e-5, atol=0)
    assert after[0, 1] == before[0, 1] and after[0, 2] == before[0, 2]  # layer 0's V and Q are untouched
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.mul_(3)  # Q after RoPE triples
    again = calibrate_kv_scales(model.get_decoder(), ids, mask)
    torch.testing.assert_close(again[0, 2], 3 * after[0, 2], rtol=1e-5, atol=0)
    assert again.shape == (2, 3) and torch.equal(again[0, :2], after[0, :2])
    assert model.config._attn_implementation == "sdpa"  # the recording attention is switched back off
    assert not torch.equal(after[1], before[1])  # layer 1 sees layer 0's changed output
    with pytest.raises(ValueError, match=r"calibration batch's attention_mask masks every token"):
        calibrate_kv_scales(model.get_decoder(), ids, torch.zeros_like(mask))


def test_caches_go_by_the_installed_transformers_keyword():
    """transformers 5.24 renamed `past_key_values` to `cache` (the old name leaves model forwards in 5.40, where it
    would be dropped silently and the FP8 KV cache with it): the calibration and the engine use the current name."""
    policy, tokenizer = load_demo_model_and_tokenizer()
    engine = ReferenceEngine(
        policy, Accelerator(cpu=True), FP8Recipe(), fp8=True, dtype=torch.float32, kv_cache=True,
        eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id, max_completion_length=3,
    )  # fmt: skip
    engine.calibration_batch = left_pad(demo_prompts(tokenizer, n=4), tokenizer.pad_token_id)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values.*")
        engine.sync_weights()  # calibrates
        engine.generate(demo_prompts(tokenizer, n=2))


def test_calibration_measures_a_training_model_as_it_samples():
    """The learner is in training mode when it recalibrates: with attention dropout the scales would change from call
    to call, and under gradient checkpointing transformers < 5.24 drops the cache it records K/V in. Calibration
    runs in eval mode and gives the training modes back."""
    model, tokenizer = load_demo_model_and_tokenizer()
    ids, mask = left_pad(demo_prompts(tokenizer), tokenizer.pad_token_id)
    expected = calibrate_kv_scales(model.get_decoder(), ids, mask)
    model.config.attention_dropout = 0.5
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    model.gradient_checkpointing_enable()
    model.train()
    model.model.layers[1].eval()  # a mixed state, given back as it was
    torch.manual_seed(0)
    assert torch.equal(calibrate_kv_scales(model.get_decoder(), ids, mask), expected)
    assert torch.equal(calibrate_kv_scales(model.get_decoder(), ids, mask), expected)
    assert model.training and model.model.layers[0].training and not model.model.layers[1].training


def test_padding_never_counts_in_the_calibration():
    """The scales come from real tokens only. The padding token's embedding is set so that layer 0 writes a larger V
    at padded positions than at any real one (after the RMSNorm, it points along v_proj's longest row); no real token
    attends to it, so every K, V and Q scale stays exactly where it was."""
    model, tokenizer = load_demo_model_and_tokenizer()
    short, long = tokenizer("12+34=")["input_ids"], tokenizer("12+34+56+78-90+11=")["input_ids"]
    assert tokenizer.pad_token_id not in short + long
    ids, mask = left_pad([short, long], tokenizer.pad_token_id)
    assert (mask == 0).sum() >= 10  # a third of the batch is padding: more than the 0.1% the percentile drops
    before = calibrate_kv_scales(model.get_decoder(), ids, mask)
    layer = model.model.layers[0]
    v_rows = layer.self_attn.v_proj.weight
    with torch.no_grad():
        model.get_input_embeddings().weight[tokenizer.pad_token_id] = (
            v_rows[v_rows.norm(dim=1).argmax()] / layer.input_layernorm.weight
        )
    after = calibrate_kv_scales(model.get_decoder(), ids, mask)
    torch.testing.assert_close(after, before, rtol=1e-6, atol=0)
    # Layer 0's V depends on each token's own embedding alone: counted as tokens, the padded positions would set it.
    counted = calibrate_kv_scales(model.get_decoder(), ids, torch.ones_like(mask))
    assert counted[0, 1] > 1.5 * before[0, 1]


def mismatch(engine, policy, prompts) -> float:
    """token_mult_prob_error between the sampler's log-probs and the learner's, on what the sampler generated."""
    torch.manual_seed(0)
    _, completions, logprobs, _ = engine.generate(prompts)
    errors = []
    for p, c, lp in zip(prompts, completions, logprobs, strict=True):
        with torch.no_grad():
            logits = policy(torch.tensor([p + c])).logits[0, len(p) - 1 : -1].float()
        learner = logits.log_softmax(-1).gather(-1, torch.tensor(c)[:, None]).squeeze(-1)
        errors.append(torch.exp((learner - torch.tensor([x[0] for x in lp])).abs()))
    return torch.cat(errors).mean().item()


def test_stale_scales_let_mismatch_grow_while_recalibrated_scales_keep_it_flat():
    """The policy drifts (its K and V projections grow 1.5x per step, as a fast-moving policy's can): scales frozen at
    step 0 saturate the cache more at every step, scales recalibrated every step do not."""
    results = {}
    for recalibrate in (True, False):
        policy, tokenizer = load_demo_model_and_tokenizer()
        prompts = demo_prompts(tokenizer, 32, seed=1)
        engine = ReferenceEngine(
            policy, Accelerator(cpu=True), FP8Recipe(), fp8=True, dtype=torch.float32, kv_cache=True,
            eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id, max_completion_length=6,
        )  # fmt: skip
        engine.calibration_batch = left_pad(prompts[:16], tokenizer.pad_token_id)
        engine.recalibrate = recalibrate
        curve = []
        for step in range(4):
            if step:
                with torch.no_grad():
                    for layer in policy.model.layers:
                        layer.self_attn.k_proj.weight.mul_(1.5)
                        layer.self_attn.v_proj.weight.mul_(1.5)
            engine.sync_weights()
            curve.append(mismatch(engine, policy, prompts))
        results[recalibrate] = curve
    print("token_mult_prob_error per step, recalibrated:", [round(x, 4) for x in results[True]])
    print("token_mult_prob_error per step, stale scales:", [round(x, 4) for x in results[False]])
    assert results[True][0] == results[False][0]  # the same first calibration
    # Recalibrated: FP8 KV noise only (a little more as the drifting attention sharpens). Stale: saturation.
    assert max(results[True]) < 1.15, "recalibrated scales must keep the mismatch low"
    assert results[False] == sorted(results[False]) and results[False][-1] > 2.0


def test_a_missing_scale_is_an_error_never_one():
    with pytest.raises(ValueError, match="layer 1 has no valid k/v scale"):
        FP8KVCache([(0.1, 0.1), (-1.0, 0.1)])
    with pytest.raises(ValueError, match="layer 0 has no valid k/v scale"):
        FP8KVCache([(0.1, 0.0)])
    assert kv_scale_inv_from_amax(torch.zeros(8)) > 0  # an all-zero layer still gets a usable scale
    policy, tokenizer = load_demo_model_and_tokenizer()
    engine = ReferenceEngine(
        policy, Accelerator(cpu=True), FP8Recipe(), fp8=True, dtype=torch.float32, kv_cache=True,
        eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="calibration_batch"):
        engine.sync_weights()
    with pytest.raises(ValueError, match="layer 0 has no valid k/v scale"):
        engine.generate(demo_prompts(tokenizer, 2))  # never synced: no scales, no silent 1.0
    engine.calibration_batch = left_pad(demo_prompts(tokenizer, 4), tokenizer.pad_token_id)
    engine.sync_weights()
    pairs = [(n, t) for n, t in engine.state_stream() if n != "model.layers.1.self_attn.v_scale"]
    with pytest.raises(ValueError, match="missing from the stream: model.layers.1.self_attn.v_scale"):
        load_state_stream(engine.sampler, pairs)
    pairs = [(n, t) for n, t in engine.state_stream() if n != "model.layers.0.self_attn.q_scale"]
    with pytest.raises(ValueError, match="missing from the stream: model.layers.0.self_attn.q_scale"):
        load_state_stream(engine.sampler, pairs)
    engine.sampler.model.layers[1].self_attn.q_scale.fill_(-1.0)
    with pytest.raises(ValueError, match=r"layer 1 has no valid q_scale \(-1.0\)"):
        engine.generate(demo_prompts(tokenizer, 2))


def test_a_refused_sync_keeps_no_scales_it_measured():
    """The K/V/Q scales measured for a sync are held only once it loaded: with `recalibrate=False` (the first scales
    kept for good) a diverged learner's NaN scales would otherwise refuse every later sync."""
    policy, tokenizer = load_demo_model_and_tokenizer()
    engine = ReferenceEngine(
        policy, Accelerator(cpu=True), FP8Recipe(), fp8=True, dtype=torch.float32, kv_cache=True,
        eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    engine.recalibrate = False
    engine.calibration_batch = left_pad(demo_prompts(tokenizer, 4), tokenizer.pad_token_id)
    norm = policy.model.layers[1].input_layernorm.weight
    good = norm.detach().clone()
    with torch.no_grad():
        norm[0] = float("nan")
    with pytest.raises(ValueError, match=r"NaN, inf or non-positive scales in \['model.layers.1.input_layernorm"):
        engine.sync_weights()
    assert engine._kv_scale_invs is None
    with torch.no_grad():
        norm.copy_(good)
    engine.sync_weights()
    held = engine._kv_scale_invs
    assert held is not None and torch.isfinite(held).all()
    assert engine.sampler.model.layers[1].self_attn.k_scale.item() == held[1, 0].item()


@pytest.mark.skipif(not available("qwen3_5"), reason="transformers has no Qwen3.5")
def test_a_hybrid_models_missing_q_scale_names_its_attention_layer():
    """In Qwen3.5 layer 0 is Gated DeltaNet and layer 1 attention: the error named the attention module's position
    among attention modules (0), not its layer."""
    engine = ReferenceEngine(
        tiny("qwen3_5"), Accelerator(cpu=True), FP8Recipe(), fp8=True, dtype=torch.float32, kv_cache=True,
        eos_token_ids=[2], pad_token_id=0, max_completion_length=2,
    )  # fmt: skip
    assert engine._attn_names == ["model.layers.1.self_attn"]
    engine.calibration_batch = (torch.randint(3, 100, (2, 8)), torch.ones(2, 8, dtype=torch.long))
    engine.sync_weights()
    engine.sampler.model.layers[1].self_attn.q_scale.fill_(-1.0)
    with pytest.raises(ValueError, match=r"layer 1 has no valid q_scale \(-1.0\)"):
        engine.generate([[1, 5, 6]])


def test_left_padding_is_masked_with_the_fp8_kv_cache():
    """Prompts of different lengths are left-padded into one batch: the FP8-query attention in front of the model's
    own must still get its padding mask (transformers builds none for an implementation its mask registry does not
    know), so a padded row reads as it does alone. The demo task's prompts are all one length: this one is not."""
    policy, tokenizer = load_demo_model_and_tokenizer()
    engine = ReferenceEngine(
        policy, Accelerator(cpu=True), FP8Recipe(), fp8=True, dtype=torch.float32, kv_cache=True,
        eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    short, long = tokenizer("12+34=")["input_ids"], tokenizer("12+34+56+78-90+11=")["input_ids"]
    engine.calibration_batch = left_pad([short, long], tokenizer.pad_token_id)
    engine.sync_weights()
    attn = [engine.sampler.get_submodule(name) for name in engine._attn_names]

    def logits(rows):
        ids, mask = left_pad(rows, tokenizer.pad_token_id)
        positions = (mask.cumsum(-1) - 1).clamp_min(0)  # as generate() numbers left-padded rows
        cache = FP8KVCache([(a.k_scale.item(), a.v_scale.item()) for a in attn])
        with torch.no_grad():
            out = engine.sampler(input_ids=ids, attention_mask=mask, position_ids=positions, **{CACHE_KWARG: cache})
        return out.logits

    batched, alone = logits([short, long])[0, -len(short) :], logits([short])[0]
    torch.testing.assert_close(batched, alone, atol=1e-4, rtol=1e-4)
    # The calibration forward routes attention through its query recorder, which must keep the mask too.
    with _recording_queries(policy):
        assert policy.config._attn_implementation in ALL_MASK_ATTENTION_FUNCTIONS


def test_end_to_end_fp8_with_fp8_kv_cache_in_the_trainer(tmp_path):
    model, tokenizer = load_demo_model_and_tokenizer()
    args = tiny_grpo_args(
        tmp_path,
        learning_rate=2e-4,
        per_device_train_batch_size=64,
        num_generations=8,
        max_completion_length=6,
        max_steps=4,
        fp8_kv_cache=True,
        gradient_checkpointing=True,  # TRL then turns the policy's use_cache off: the sampler must still cache
    )
    trainer = FP8GRPOTrainer(
        model=model,
        reward_funcs=accuracy_reward,
        args=args,
        train_dataset=make_dataset(256),
        processing_class=tokenizer,
    )
    trainer.train()
    logs = [log for log in trainer.state.log_history if "sampling/token_mult_prob_error" in log]
    errors = [log["sampling/token_mult_prob_error"] for log in logs]
    calibration = [log["fp8/kv_calibration_seconds"] for log in logs]
    share = sum(calibration) / sum(log["step_time"] for log in logs)
    rounded = [round(e, 4) for e in errors]
    print(f"FP8/FP8 + FP8 KV: token_mult_prob_error {rounded}, calibration {share:.1%} of step time")
    assert len(errors) == 4 and sum(errors) / len(errors) < 1.1
    engine = trainer.vllm_generation
    assert dict(engine.state_stream())["model.layers.0.self_attn.k_scale"] > 0
    # The engine's log-probs are those of the FP8-KV sampler on the same sequences (no cache-less recompute).
    prompts = demo_prompts(tokenizer, 8)
    _, completions, logprobs, _ = engine.generate(prompts)
    scales = [
        (a.k_scale.item(), a.v_scale.item()) for a in (engine.sampler.get_submodule(n) for n in engine._attn_names)
    ]
    for p, c, lp in zip(prompts, completions, logprobs, strict=True):
        with torch.no_grad():
            out = engine.sampler(torch.tensor([p + c]), use_cache=True, **{CACHE_KWARG: FP8KVCache(scales)})
        full = out.logits[0, len(p) - 1 : -1].log_softmax(-1).gather(-1, torch.tensor(c)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor([x[0] for x in lp]), full, atol=1e-4, rtol=1e-4)


def test_the_kv_scale_fields_set_the_samplers_scales(tmp_path):
    """`fp8_kv_scale_percentile` and `fp8_kv_scale_margin` set the scales the trainer's sampler holds: the reference
    engine FP8GRPOTrainer builds measures its Q/K/V scales with them (validated and then ignored, they would change
    nothing)."""
    model, tokenizer = load_demo_model_and_tokenizer()
    args = tiny_grpo_args(
        tmp_path, fp8_kv_cache=True, fp8_kv_scale_percentile=50.0, fp8_kv_scale_margin=3.0, max_steps=1
    )
    trainer = FP8GRPOTrainer(
        model=model, reward_funcs=accuracy_reward, args=args, train_dataset=make_dataset(16),
        processing_class=tokenizer,
    )  # fmt: skip
    engine = trainer.vllm_generation
    prompts = [tokenizer(p)["input_ids"] for p in make_dataset(4, seed=1)["prompt"]]
    engine.calibration_batch = left_pad(prompts, tokenizer.pad_token_id)
    engine.sync_weights()
    ids, mask = engine.calibration_batch
    want = calibrate_kv_scales(trainer.model.get_decoder(), ids, mask, percentile=50.0, margin=3.0)
    default = calibrate_kv_scales(trainer.model.get_decoder(), ids, mask)
    assert not torch.equal(want, default)
    torch.testing.assert_close(engine._kv_scale_invs, want, rtol=0, atol=0)
    held = engine.sampler.get_submodule(engine._attn_names[0])
    assert (held.k_scale.item(), held.v_scale.item(), held.q_scale.item()) == tuple(want[0].tolist())


def test_kv_calibration_runs_on_rows_spread_over_the_latest_training_batch(tmp_path):
    """`fp8_kv_calibration_rows` sequences: of the first batch's prompts before any batch is finished, then of the
    latest training batch, prompts and completions. They are spread over the batch, which holds each prompt's
    generations side by side, so that two rows come from two prompts. An evaluation's batch never replaces them."""
    model, tokenizer = load_demo_model_and_tokenizer()
    trainer = FP8GRPOTrainer(
        model=model,
        reward_funcs=accuracy_reward,
        args=tiny_grpo_args(tmp_path, fp8_kv_cache=True, fp8_kv_calibration_rows=2),
        train_dataset=make_dataset(16),
        processing_class=tokenizer,
    )
    engine, calibrated_on = trainer.vllm_generation, []
    calibrate = engine._measure_kv_scales

    def recording_calibrate():
        calibrated_on.append(engine.calibration_batch[0].clone())
        return calibrate()

    engine._measure_kv_scales = recording_calibrate
    # As TRL's sampler orders a batch: 2 prompts x 4 generations, each prompt's side by side.
    batch = [trainer.train_dataset[i] for i in (0, 1) for _ in range(trainer.num_generations)]
    assert batch[0]["prompt"] != batch[-1]["prompt"]
    prompts = [tokenizer(batch[i]["prompt"])["input_ids"] for i in (0, -1)]
    trainer.model.train()
    trainer._generate_and_score_completions(batch)
    assert [row[-len(p) :].tolist() for row, p in zip(calibrated_on[0], prompts, strict=True)] == prompts
    kept = engine.calibration_batch
    assert kept[0].shape[0] == 2 and kept[0].shape[1] > max(map(len, prompts))  # prompts with completions
    for row, mask, prompt in zip(*kept, prompts, strict=True):  # one row from each prompt's group
        assert row[mask.bool()][: len(prompt)].tolist() == prompt
    trainer.model.eval()
    trainer._generate_and_score_completions(batch)
    assert engine.calibration_batch is kept


def test_the_reference_engine_refuses_an_fp8_kv_cache_for_latent_attention():
    from trl_fp8.demo.tiny_moe import MOONLIGHT_RECIPE, tiny_deepseek_v3

    with pytest.raises(ValueError, match=r"not supported for deepseek_v3: its multi-head latent attention"):
        ReferenceEngine(
            tiny_deepseek_v3(), Accelerator(cpu=True), MOONLIGHT_RECIPE, fp8=True, dtype=torch.float32,
            kv_cache=True, eos_token_ids=[1], pad_token_id=0,
        )  # fmt: skip
