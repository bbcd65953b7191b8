"""The FP8 KV cache across architectures: every family decodes through it as it reads the whole sequence, layers that
read another layer's K/V (Gemma 3n, Gemma 4) take that layer's scales, and what cannot hold the cache is refused by
name, before the trainer converts anything. And the attention itself: queries through E4M3 under their q_scale."""

import sys

import pytest
import torch
import transformers
from accelerate import Accelerator
from conftest import tiny_grpo_args, tiny_model
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from trl_fp8 import FP8GRPOConfig, FP8GRPOTrainer, FP8Recipe
from trl_fp8.demo.families import FAMILIES, available, tiny
from trl_fp8.demo.task import accuracy_reward, make_dataset
from trl_fp8.generation.reference import ReferenceEngine, left_pad
from trl_fp8.quant.kv_cache import (
    CACHE_KWARG,
    FP8_QUERY_ATTENTION,
    FP8KVCache,
    _base_attention,
    attention_module_names,
    calibrate_kv_scales,
    dequantize_kv,
    kv_shared_sources,
    quantize_kv,
    set_attention,
)


@pytest.mark.parametrize("family", ["gemma4", "gemma3n"])
def test_a_layer_reading_another_layers_kv_takes_that_layers_scales(monkeypatch, family):
    """Gemma 4's and Gemma 3n's last `num_kv_shared_layers` layers attend over an earlier layer's K/V: they read its
    FP8 codes, so they take its K/V scales (vLLM dequantizes what a shared layer reads with the shared layer's own
    `k_scale`, and a checkpoint carries them); their queries are their own. Calibration failed on them before ("the
    forward stored K/V for layers [0, 1] of [0, 1, 2]"), and they were refused."""
    from trl_fp8.quant import kv_cache

    if family == "gemma4" and not available("gemma4"):
        pytest.skip(f"transformers {transformers.__version__} has no Gemma 4")
    model = tiny(family)
    assert kv_shared_sources(model.config) == {2: 1}  # the last earlier full-attention layer
    ids, mask = left_pad([[1, 5, 6, 7, 8, 9, 10], [1, 11, 12, 13]], 0)
    # Through the causal LM (FSDP2's path), whose last-logits forward runs the shared layers on the last positions
    # only unless asked for more, as through its decoder: every token measured.
    assert torch.equal(calibrate_kv_scales(model, ids, mask), calibrate_kv_scales(model.get_decoder(), ids, mask))
    engine = ReferenceEngine(
        model, Accelerator(cpu=True), FP8Recipe(), fp8=True, dtype=torch.float32, kv_cache=True,
        eos_token_ids=[2], pad_token_id=0, max_completion_length=6,
    )  # fmt: skip
    engine.calibration_batch = (ids, mask)
    engine.sync_weights()
    attn = {a.layer_idx: a for a in (engine.sampler.get_submodule(n) for n in engine._attn_names)}
    assert [attn[2].k_scale.item(), attn[2].v_scale.item()] == [attn[1].k_scale.item(), attn[1].v_scale.item()]
    assert attn[2].q_scale.item() != attn[1].q_scale.item()
    # What the shared layer attends over, in prefill and every decode step: its source's E4M3 codes.
    read = []
    base = kv_cache._base_attention

    def spying(module):
        def attend(module, query, key, value, *args, **kwargs):
            if module.layer_idx == 2:
                read.append((key, value))
            return base(module)(module, query, key, value, *args, **kwargs)

        return attend

    monkeypatch.setattr(kv_cache, "_base_attention", spying)
    engine.generate([[1, 5, 6, 7], [1, 11, 12]])
    assert len(read) > 1
    for key, value in read:
        for x, s in ((key, attn[1].k_scale.item()), (value, attn[1].v_scale.item())):
            assert torch.equal(dequantize_kv(quantize_kv(x, s), s, x.dtype), x)


@pytest.mark.skipif(not available("gemma4"), reason="transformers has no Gemma 4")
def test_gemma4_trains_with_the_fp8_kv_cache_and_its_checkpoint_gives_the_shared_layer_its_sources_scales(
    tmp_path, demo_tokenizer
):
    """The trainer end to end, and the FP8 checkpoint vLLM serves with `kv_cache_dtype="fp8"`: Gemma 4's KV-shared
    layer 2 carries layer 1's K and V scales and a Q scale of its own, as the sampler held them."""
    trainer = FP8GRPOTrainer(
        model=tiny("gemma4"), reward_funcs=accuracy_reward, train_dataset=make_dataset(8),
        processing_class=demo_tokenizer,
        args=tiny_grpo_args(tmp_path, max_steps=1, fp8_kv_cache=True, fp8_save_format="fp8"),
    )  # fmt: skip
    trainer.train()
    trainer.save_model(str(tmp_path / "fp8"))
    saved = load_file(tmp_path / "fp8" / "model.safetensors")
    scales = {(i, x): saved[f"model.layers.{i}.self_attn.{x}_scale"] for i in range(3) for x in "kvq"}
    assert all(s > 0 for s in scales.values())
    assert torch.equal(scales[2, "k"], scales[1, "k"]) and torch.equal(scales[2, "v"], scales[1, "v"])
    assert not torch.equal(scales[2, "q"], scales[1, "q"])


@pytest.mark.skipif(not available("gemma4"), reason="transformers has no Gemma 4")
def test_a_model_whose_layers_all_read_kv_stored_elsewhere_is_refused_by_name():
    with pytest.raises(ValueError, match=r"not supported for gemma4_text: its layers \[0, 1, 2\] \(of the last"):
        ReferenceEngine(
            tiny("gemma4", num_kv_shared_layers=3), Accelerator(cpu=True), FP8Recipe(), fp8=True,
            dtype=torch.float32, kv_cache=True, eos_token_ids=[2], pad_token_id=0,
        )  # fmt: skip


def test_the_trainer_refuses_it_before_converting_the_model_it_was_given(tmp_path):
    from trl_fp8.demo.tiny_moe import tiny_deepseek_v3

    model = tiny_deepseek_v3()
    with pytest.raises(ValueError, match=r"fp8_kv_cache=True is not supported for deepseek_v3"):
        FP8GRPOTrainer(
            model=model, reward_funcs=accuracy_reward, train_dataset=make_dataset(8),
            args=tiny_grpo_args(tmp_path, fp8_kv_cache=True),
        )  # fmt: skip
    assert getattr(model, "fp8_recipe", None) is None  # the caller's model is left as it was
    # Given as a path, it is refused from its config, before any weight is read: here there are none to read.
    tiny("gpt_neox").config.save_pretrained(tmp_path / "gpt_neox")
    with pytest.raises(ValueError, match=r"not supported for gpt_neox: its attention modules are not named"):
        FP8GRPOTrainer(
            model=str(tmp_path / "gpt_neox"), reward_funcs=accuracy_reward, train_dataset=make_dataset(8),
            args=tiny_grpo_args(tmp_path, fp8_kv_cache=True),
        )  # fmt: skip


def test_kv_cache_config_errors(tmp_path):
    with pytest.raises(ValueError, match="fp8_kv_cache=True needs fp8_generation=True"):
        FP8GRPOConfig(output_dir=str(tmp_path), use_cpu=True, fp8_kv_cache=True, fp8_generation=False)
    with pytest.raises(ValueError, match="fp8_kv_scale_percentile"):
        FP8GRPOConfig(output_dir=str(tmp_path), use_cpu=True, fp8_kv_scale_percentile=0)
    with pytest.raises(ValueError, match="fp8_kv_scale_margin"):
        FP8GRPOConfig(output_dir=str(tmp_path), use_cpu=True, fp8_kv_scale_margin=-1)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "gpt_neox"])
def test_every_family_decodes_through_the_fp8_kv_cache_as_it_reads_the_whole_sequence(family):
    """The engine's log-probs, decoded token by token through the FP8 KV cache, are those of one forward over the
    whole sequence through a fresh FP8 KV cache (which quantizes the current tokens as it stores them), in every
    family: sliding windows (Gemma 3), eager attention with what sdpa lacks (Gemma 2's softcapping, which sdpa
    refused, and GPT-OSS's sinks, which it dropped: both now run the model's own eager function), and hybrid models
    whose Gated DeltaNet layers keep a recurrent state in transformers' own cache layers beside the FP8 attention
    layers (Qwen3.5, Qwen3-Next: an IndexError at the first sync before).

    Not bit for bit: a token's K/V come out of a 1-token GEMM in decoding and a whole-sequence GEMM here, about 1e-7
    apart in fp32, which now and then lands on either side of an E4M3 rounding boundary: one code step that every
    later token reads (up to 0.08 in log-prob seen over these families; most tokens agree to 1e-6)."""
    if not available(family):
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    torch.manual_seed(0)
    model = tiny(family)
    engine = ReferenceEngine(
        model, Accelerator(cpu=True), FP8Recipe(), fp8=True, dtype=torch.float32, kv_cache=True,
        eos_token_ids=[2], pad_token_id=0, max_completion_length=12,
    )  # fmt: skip
    prompts = [[1, 5, 6, 7, 8, 9, 10], [1, 11, 12, 13, 14, 15, 16]]
    engine.calibration_batch = left_pad(prompts, 0)
    engine.sync_weights()
    _, completions, logprobs, _ = engine.generate(prompts)
    attn = [engine.sampler.get_submodule(n) for n in engine._attn_names]
    scales = {a.layer_idx: (a.k_scale.item(), a.v_scale.item()) for a in attn}
    for p, c, lp in zip(prompts, completions, logprobs, strict=True):
        cache = FP8KVCache(scales, engine.sampler.config)
        with torch.no_grad():
            out = engine.sampler(torch.tensor([p + c]), use_cache=True, **{CACHE_KWARG: cache})
        full = out.logits[0, len(p) - 1 : -1].log_softmax(-1).gather(-1, torch.tensor(c)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor([x[0] for x in lp]), full, atol=0.25, rtol=0)
    if engine.sampler.config._attn_implementation.endswith("eager"):
        own = sys.modules[type(attn[0]).__module__].eager_attention_forward
        assert all(_base_attention(a) is own for a in attn)


def test_fp8_kv_cache_is_refused_where_it_cannot_hold_the_cache():
    """Refused at start, by name, instead of failing at the first sync: GPT-NeoX names its attention `attention`, where
    vLLM would find no `self_attn.k_scale` to load; Falcon-H1's layers run Mamba beside attention, one cache layer
    holding a recurrent state and K/V together, which the FP8 KV cache has no layer for."""
    falcon_h1 = transformers.FalconH1Config(
        vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, mamba_d_ssm=256, mamba_n_heads=4, mamba_d_head=64, mamba_d_state=16,
        mamba_n_groups=1, mamba_chunk_size=16,
    )  # fmt: skip
    refused = [
        (tiny("gpt_neox"), r"not supported for gpt_neox: its attention modules are not named `self_attn`"),
        (
            transformers.FalconH1ForCausalLM(falcon_h1),
            r"not supported for falcon_h1: its layers \[0, 1\] keep a recurrent state and a K/V cache together",
        ),
    ]
    for model, message in refused:
        with pytest.raises(ValueError, match=message):
            ReferenceEngine(
                model, Accelerator(cpu=True), FP8Recipe(), fp8=True, dtype=torch.float32, kv_cache=True,
                eos_token_ids=[2], pad_token_id=0,
            )  # fmt: skip
    # Every decoder layer needs K/V scales or, from the model's config, a recurrent state in the FP8 KV cache.
    with pytest.raises(ValueError, match=r"decoder layer 1 has neither K/V scales nor a recurrent state"):
        FP8KVCache({0: (0.1, 0.1), 2: (0.1, 0.1)})


def _reference_fp8_query(module, query, *args, **kwargs):
    """sdpa on queries quantized as vLLM's FlashAttention-3 `query_quant` does: E4M3 codes under the static q_scale."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    s = float(module.q_scale)
    q = torch.clamp(query.float() / s, -448.0, 448.0).to(torch.float8_e4m3fn).float() * s
    return sdpa_attention_forward(module, q.to(query.dtype), *args, **kwargs)


def test_the_samplers_queries_go_through_e4m3_with_their_q_scale():
    """With the FP8 KV cache the sampler's attention quantizes its queries with the layer's static `q_scale`, as vLLM
    does: the model's logits equal those of sdpa on queries quantized by that rule (registered under a test name)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("test_reference_fp8_query", _reference_fp8_query)
    AttentionMaskInterface.register("test_reference_fp8_query", sdpa_mask)
    model = tiny_model(LlamaConfig, LlamaForCausalLM, attn_implementation="sdpa")
    names = attention_module_names(model)
    for i, name in enumerate(names):  # coarse scales, so that the E4M3 rounding of the queries shows in the logits
        model.get_submodule(name).register_buffer("q_scale", torch.tensor(0.05 * (i + 1)))
    ids = torch.randint(0, 160, (2, 9))
    with torch.no_grad():
        plain = model(ids).logits
        set_attention(model, names, FP8_QUERY_ATTENTION)
        fp8_query = model(ids).logits
        model.config._attn_implementation = "test_reference_fp8_query"
        reference = model(ids).logits
    assert torch.equal(fp8_query, reference) and not torch.equal(fp8_query, plain)
