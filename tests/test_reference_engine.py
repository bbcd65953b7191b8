"""The reference sampling engine behind FP8GRPOTrainer: it holds the learner's FP8 weights bit for bit, refits when
(and only when) the learner changed, keeps its last good weights when a sync fails, and returns the log-probs of the
distribution it sampled from. On the real tiny Llama and tokenizer, through the trainer."""

import pytest
import torch
from accelerate import Accelerator
from conftest import digit_trainer, families, tiny_config_kwargs, tiny_grpo_args, tiny_policy, train_and_check

from trl_fp8 import FP8GRPOTrainer, FP8Recipe
from trl_fp8.demo.families import tiny
from trl_fp8.demo.task import digit_count_reward as digit_reward
from trl_fp8.demo.task import make_dataset
from trl_fp8.generation.reference import ReferenceEngine
from trl_fp8.quant import FP8Linear, W8A8Linear, iter_fp8_state, quantize_blockwise


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
    # An engine over a converted learner takes the learner's recipe, whatever it is given.
    engine = ReferenceEngine(
        trainer.model, trainer.accelerator, FP8Recipe(pow2_scales=not pow2), fp8=True, dtype=torch.float32,
        eos_token_ids=[demo_tokenizer.eos_token_id], pad_token_id=demo_tokenizer.pad_token_id,
    )  # fmt: skip
    assert all(m.pow2_scales == pow2 for m in engine.sampler.modules() if isinstance(m, W8A8Linear))


def test_the_fp8_sampler_takes_128x128_weight_blocks_only(tmp_path, demo_tokenizer):
    """Refused when it is built, rather than by every scale's shape at the first sync."""
    with pytest.raises(ValueError, match=r"recipe.weight_block_size \[64, 64\]: the FP8 sampler takes 128x128"):
        ReferenceEngine(
            tiny_policy(demo_tokenizer), Accelerator(cpu=True), FP8Recipe(weight_block_size=[64, 64]), fp8=True,
            dtype=torch.float32, eos_token_ids=[demo_tokenizer.eos_token_id], pad_token_id=demo_tokenizer.pad_token_id,
        )  # fmt: skip


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


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8_sampler", "bf16_sampler"])
def test_a_weight_named_like_a_scale_is_cast_as_a_weight(fp8):
    """Only the stream's scales (`weight_scale_inv`, the KV cache's `k_scale`/`v_scale`/`q_scale`) keep their own
    dtype: a model weight whose name ends in `_scale` (Gemma 3n's `altup.correct_output_scale`) is cast to the
    sampler's dtype like any weight. It used to keep the fp32 learner's dtype, and a bf16 sampler refused every
    sync."""
    from accelerate import Accelerator
    from transformers import Gemma3nForCausalLM, Gemma3nTextConfig

    torch.manual_seed(0)
    config = Gemma3nTextConfig(
        vocab_size=128, vocab_size_per_layer_input=128, hidden_size=256, hidden_size_per_layer_input=128,
        intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        laurel_rank=128, num_kv_shared_layers=0, activation_sparsity_pattern=[0.0, 0.0],
        layer_types=["sliding_attention", "full_attention"], sliding_window=16, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    learner = Gemma3nForCausalLM(config)  # fp32, as TRL loads a policy before bf16 autocast
    engine = ReferenceEngine(
        learner, Accelerator(cpu=True), FP8Recipe(), fp8=fp8, dtype=torch.bfloat16, eos_token_ids=[2], pad_token_id=0
    )
    engine.sync_weights()
    name = "model.layers.0.altup.correct_output_scale"
    held = engine.sampler.get_parameter(name)
    assert held.dtype == torch.bfloat16
    assert torch.equal(held, learner.get_parameter(name).detach().to(torch.bfloat16))


@pytest.mark.parametrize("cache", [None, "static"], ids=["dynamic_cache", "static_cache"])
def test_engine_logprobs_are_the_samplers_processed_logprobs(tmp_path, demo_tokenizer, cache):
    """Also with `cache_implementation`, which the engine decodes with as TRL's transformers path would (and, as that
    path, never compiled on its own: transformers would compile the decode under a static cache on a GPU)."""
    temperature = 0.7
    trainer = digit_trainer(
        tmp_path, demo_tokenizer, temperature=temperature, max_completion_length=6, cache_implementation=cache
    )
    engine = trainer.vllm_generation
    assert engine.generation_config.cache_implementation == cache
    assert engine.generation_config.disable_compile is True
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
        # A KV-cached decode and this full forward give bf16 activations that differ in their last bits, which an
        # FP8 activation code can amplify: up to 5e-4 relative (2.6e-3 nats) here. The raw (temperature 1) log-probs
        # would be 1.5-7% off (0.07-0.3 nats) on some token of every sequence.
        torch.testing.assert_close(torch.tensor([lp[0] for lp in lps]), expected, atol=1e-4, rtol=2e-3)


def _top_p(logits, p):  # vLLM's apply_top_k_top_p: the least likely tokens whose mass stays within 1 - p go
    ordered, index = logits.sort(-1)
    drop = ordered.softmax(-1).cumsum(-1) <= 1 - p
    drop[..., -1] = False
    return logits.scatter(-1, index, ordered.masked_fill(drop, -float("inf")))


def _min_p(logits, p):
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < p * probs.amax(-1, keepdim=True), -float("inf"))


def test_min_p_filters_before_top_p_as_in_vllm():
    """vLLM's sampler: temperature, then min-p, then top-k/top-p, and the log-probs of what is left. transformers
    runs min-p last, so that top-p cut the tail at another token: the engine's log-probs were 0.18 nats off on a
    token of every completion here. An fp32 sampler in high precision: a cached decode and a full forward agree to
    1e-6, and no token sits that close to a cut."""
    from trl_fp8.demo.task import load_demo_model_and_tokenizer

    model, tokenizer = load_demo_model_and_tokenizer()
    temperature, min_p, top_p = 2.0, 0.1, 0.8
    engine = ReferenceEngine(
        model, Accelerator(cpu=True), FP8Recipe(), fp8=False, dtype=torch.float32, temperature=temperature,
        min_p=min_p, top_p=top_p, max_completion_length=8, eos_token_ids=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    engine.sync_weights()
    prompts = [tokenizer(p)["input_ids"] for p in make_dataset(16)["prompt"]]
    torch.manual_seed(0)
    _, completions, logprobs, _ = engine.generate(prompts)
    moved = 0
    for prompt, completion, lps in zip(prompts, completions, logprobs, strict=True):
        with torch.no_grad():
            logits = engine.sampler(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1] / temperature
        sampled = torch.tensor(completion)[:, None]
        vllm = _top_p(_min_p(logits, min_p), top_p).log_softmax(-1).gather(-1, sampled).squeeze(-1)
        torch.testing.assert_close(torch.tensor([lp[0] for lp in lps]), vllm, atol=1e-5, rtol=0)
        transformers_order = _min_p(_top_p(logits, top_p), min_p).log_softmax(-1).gather(-1, sampled).squeeze(-1)
        moved += bool((transformers_order - vllm).abs().max() > 1e-2)
    assert moved >= len(prompts) // 2  # the two orders differ here: the check above can tell them apart


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


def test_weights_tied_in_the_sampler_but_not_in_the_learner_are_refused():
    """The sampler is built from the config, which says tied; a learner whose head was untied in memory streams both
    tensors, and both landed in the sampler's one tensor, the last winning."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    learner = LlamaForCausalLM(LlamaConfig(**tiny_config_kwargs(tie_word_embeddings=True)))
    learner.lm_head.weight = torch.nn.Parameter(3 * learner.model.embed_tokens.weight.detach())
    engine = ReferenceEngine(
        learner, Accelerator(cpu=True), FP8Recipe(), fp8=True, dtype=torch.float32, eos_token_ids=[2], pad_token_id=0
    )
    before = engine.sampler.lm_head.weight.clone()
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight and lm_head.weight: one tensor in the sampler"):
        engine.sync_weights()
    assert torch.equal(engine.sampler.lm_head.weight, before)
    learner.lm_head.weight = learner.model.embed_tokens.weight  # tied again: one name in the stream
    engine.sync_weights()
    assert torch.equal(engine.sampler.lm_head.weight, learner.lm_head.weight)


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
    # Another Parameter in its place, with the same version counter: the tensor object tells them apart.
    old = trainer.model.model.norm.weight
    new = torch.nn.Parameter(old.detach() * 3)
    with torch.no_grad():
        for _ in range(old._version - new._version):
            new.mul_(1)
    assert new._version == old._version
    trainer.model.model.norm.weight = new
    engine.last_sync = None
    engine.sync_weights()
    assert engine.last_sync is not None and torch.equal(engine.sampler.model.norm.weight, new)


@pytest.mark.parametrize("family", families("gemma4"))
def test_a_change_to_a_checkpoint_buffer_alone_is_sent(tmp_path, demo_tokenizer, family):
    """Gemma 4's per-layer `layer_scalar` is a persistent buffer (a router's `e_score_correction_bias` is another): the
    stream carries it, so changing it alone, with every parameter as it was, refits the sampler."""
    trainer = digit_trainer(tmp_path, demo_tokenizer, model=tiny(family))
    engine = trainer.vllm_generation
    engine.sync_weights()
    engine.last_sync = None
    learner = trainer.model.model.layers[1]
    with torch.no_grad():
        learner.layer_scalar.mul_(0.5)
    engine.sync_weights()
    assert engine.last_sync is not None
    assert torch.equal(engine.sampler.model.layers[1].layer_scalar, learner.layer_scalar)


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


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_sampler_computes_logits_in_fp32_when_the_learner_does(tmp_path, demo_tokenizer, tied):
    """`cast_lm_head_to_fp32=True` makes TRL compute the learner's logits from an fp32 head on fp32 hidden states;
    under `bf16=True` the sampler then does the same (a bf16 head would add its own rounding to the mismatch), holds
    the learner's fp32 head bit for bit, and, with tied embeddings, still feeds its layers bf16 activations."""
    model = tiny_policy(demo_tokenizer)
    if tied:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    trainer = FP8GRPOTrainer(
        model=model,
        reward_funcs=digit_reward,
        args=tiny_grpo_args(tmp_path, bf16=True, cast_lm_head_to_fp32=True, max_steps=1),
        train_dataset=make_dataset(16),
        processing_class=demo_tokenizer,
    )
    trainer.train()
    engine = trainer.vllm_generation
    engine.sync_weights()
    sampler, learner = engine.sampler, trainer.model
    assert sampler.lm_head.weight.dtype == learner.lm_head.weight.dtype == torch.float32
    assert torch.equal(sampler.lm_head.weight, learner.lm_head.weight.detach())
    assert (sampler.lm_head.weight is sampler.model.embed_tokens.weight) == tied
    ids = torch.tensor([demo_tokenizer("12+34=")["input_ids"]])
    assert sampler.model.embed_tokens(ids).dtype == torch.bfloat16
    with torch.no_grad():
        hidden = sampler.model(ids).last_hidden_state
        logits = sampler(ids).logits
    assert hidden.dtype == torch.bfloat16 and logits.dtype == torch.float32
    assert torch.equal(logits, hidden.float() @ sampler.lm_head.weight.T)
    assert isinstance(sampler.model.layers[0].self_attn.q_proj, W8A8Linear)
