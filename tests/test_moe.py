"""Mixture-of-Experts in FP8 on tiny Qwen3-MoE and DeepSeek-V3-style models built in-process (4 experts, top-2)."""

import copy
import json

import pytest
import torch
from conftest import MOVES, tiny_grpo_args
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from trl_fp8 import FP8GRPOTrainer, FP8Recipe, convert_to_fp8
from trl_fp8.demo.task import digit_count_reward as digit_reward
from trl_fp8.demo.task import make_dataset
from trl_fp8.demo.tiny_moe import MOONLIGHT_RECIPE as MOONLIGHT
from trl_fp8.demo.tiny_moe import tiny_deepseek_v3 as deepseek_v3
from trl_fp8.demo.tiny_moe import tiny_qwen3_moe as qwen3_moe
from trl_fp8.generation import build_sampler_model
from trl_fp8.generation.vllm_layout import check_vllm_fp8_layers
from trl_fp8.quant import FP8Linear, dequantize_blockwise, iter_fp8_state, quantize_blockwise
from trl_fp8.quant.export import load_state_stream
from trl_fp8.quant.fp8_checkpoint import save_fp8_checkpoint
from trl_fp8.quant.moe import FP8Experts, W8A8Experts, capture_routing, is_fused_experts


def test_per_expert_quantization_equals_quantizing_each_expert_alone():
    model = convert_to_fp8(qwen3_moe(), FP8Recipe())
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, FP8Experts)
    q, s = experts.quantized("gate_up_proj")
    for e in range(4):
        for part, rows in (("gate", slice(0, 128)), ("up", slice(128, 256))):
            q_ref, s_ref = quantize_blockwise(experts.gate_up_proj[e, rows].detach(), (128, 128))
            assert torch.equal(q[e, rows].view(torch.uint8), q_ref.view(torch.uint8)), (e, part)
            assert torch.equal(s[e, rows.start // 128 : rows.stop // 128], s_ref), (e, part)


@pytest.mark.parametrize(
    "build,recipe", [(qwen3_moe, FP8Recipe()), (deepseek_v3, MOONLIGHT)], ids=["qwen3_moe", "deepseek_v3"]
)
def test_export_names_and_shapes_match_vllm_checkpoints(build, recipe):
    model = convert_to_fp8(build(), recipe)
    layer = 0 if build is qwen3_moe else 1
    stream = dict(iter_fp8_state(model))
    prefix = f"model.layers.{layer}.mlp.experts"
    for e in range(4):
        for proj, shape in (("gate_proj", (128, 256)), ("up_proj", (128, 256)), ("down_proj", (256, 128))):
            w, s = stream[f"{prefix}.{e}.{proj}.weight"], stream[f"{prefix}.{e}.{proj}.weight_scale_inv"]
            assert tuple(w.shape) == shape and w.dtype == torch.float8_e4m3fn
            assert tuple(s.shape) == (shape[0] // 128, shape[1] // 128) and s.dtype == torch.float32
    assert f"{prefix}.gate_up_proj" not in stream and f"{prefix}.down_proj" not in stream
    router = f"model.layers.{layer}.mlp.gate.weight"
    assert stream[router].dtype == torch.float32  # the router stays in high precision
    if build is deepseek_v3:
        assert stream["model.layers.1.self_attn.kv_b_proj.weight"].dtype == torch.float32  # Moonlight: MLA in BF16
        assert stream["model.layers.1.mlp.shared_experts.gate_proj.weight"].dtype == torch.float8_e4m3fn


@pytest.mark.parametrize(
    "recipe",
    [FP8Recipe(modules_to_not_convert=["mlp.experts"]), FP8Recipe(num_first_layers_in_bf16=1)],
    ids=["experts_in_bf16", "first_layer_in_bf16"],
)
def test_fp8_checkpoint_stores_high_precision_experts_as_vllm_loads_them(tmp_path, recipe):
    """A saved checkpoint holds what the sampler sync sends: high-precision experts one by one (as vLLM loads them
    and Hub checkpoints store them), listed with the routers in `modules_to_not_convert` (as in vLLM's
    `ignored_layers`, or a loader would expect FP8 experts with scales)."""
    model = convert_to_fp8(qwen3_moe(), recipe)
    save_fp8_checkpoint(model, str(tmp_path), recipe)
    tensors = load_file(tmp_path / "model.safetensors")
    kept = json.loads((tmp_path / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    assert not [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    gate = "model.layers.0.mlp.experts.3.gate_proj.weight"
    assert tensors[gate].dtype == torch.float32 and f"{gate}_scale_inv" not in tensors
    assert torch.equal(tensors[gate], model.model.layers[0].mlp.experts.gate_up_proj[3, :128])
    assert {"model.layers.0.mlp.experts", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"} <= set(kept)
    assert ("model.layers.1.mlp.experts" in kept) == (recipe.num_first_layers_in_bf16 == 0)
    assert sorted(kept) == sorted(["lm_head", *check_vllm_fp8_layers(model, recipe)])
    # transformers fuses the experts back at load time: every expert weight as the learner holds it.
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    for name in ("gate_up_proj", "down_proj"):
        torch.testing.assert_close(
            getattr(loaded.model.layers[0].mlp.experts, name),
            getattr(model.model.layers[0].mlp.experts, name).detach(),
            atol=0,
            rtol=0,
        )


@pytest.mark.parametrize(
    "build,recipe", [(qwen3_moe, FP8Recipe()), (deepseek_v3, MOONLIGHT)], ids=["qwen3_moe", "deepseek_v3"]
)
def test_export_to_reference_engine_round_trip_is_bit_identical(build, recipe):
    learner = convert_to_fp8(build(), recipe)
    sampler = build_sampler_model(learner, recipe, fp8=True, dtype=torch.float32)
    experts = [m for m in sampler.modules() if isinstance(m, W8A8Experts)]
    assert len(experts) == (2 if build is qwen3_moe else 1)
    stream = list(iter_fp8_state(learner))
    load_state_stream(sampler, iter_fp8_state(learner))  # the generator itself
    state = sampler.state_dict()
    for name, tensor in stream:
        a = state[name].view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else state[name]
        b = tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor
        assert torch.equal(a, b), name
    # The sampler's experts compute with the learner's expert weights: same routing in, close outputs out.
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(sampler(ids).logits, learner(ids).logits, atol=0.05, rtol=0.05)
    e0 = experts[0][0]
    name = next(n for n, m in sampler.named_modules() if m is experts[0])
    fused = dict(learner.named_modules())[name]
    w_dq = dequantize_blockwise(*fused.quantized("down_proj"))[0]
    assert torch.equal(e0.down_proj.dequantized_weight(), w_dq)
    gate_up = dequantize_blockwise(*fused.quantized("gate_up_proj"))[0]
    inter = gate_up.shape[0] // 2
    assert torch.equal(e0.gate_proj.dequantized_weight(), gate_up[:inter])
    assert torch.equal(e0.up_proj.dequantized_weight(), gate_up[inter:])


@pytest.mark.parametrize(
    "build,recipe", [(qwen3_moe, FP8Recipe()), (deepseek_v3, MOONLIGHT)], ids=["qwen3_moe", "deepseek_v3"]
)
def test_fp8_grpo_trains_moe_end_to_end(tmp_path, demo_tokenizer, build, recipe):
    args = tiny_grpo_args(tmp_path, fp8_recipe=recipe.to_dict())
    trainer = FP8GRPOTrainer(
        model=build(demo_tokenizer),
        reward_funcs=digit_reward,
        args=args,
        train_dataset=make_dataset(16),
        processing_class=demo_tokenizer,
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor(log["loss"])) for log in logs)
    for key in ("sampling/token_mult_prob_error", "fp8/router_mismatch"):
        assert all(key in log for log in logs), key
    assert all(0.0 <= log["fp8/router_mismatch"] <= 1.0 for log in logs)
    if build is qwen3_moe:  # its config's router_aux_loss_coef (0.001) turns TRL's load-balancing loss on
        assert trainer.aux_loss_enabled
        assert all(log["aux_loss"] > 0 and torch.isfinite(torch.tensor(log["aux_loss"])) for log in logs)
    for n, p in trainer.model.named_parameters():
        assert not torch.equal(p, before[n]), f"parameter {n} did not change"


def test_converted_moe_deep_copies_after_a_forward():
    """TRL and users deep-copy policies (a reference model, an EMA): the resolved backends and caches must not
    make a converted model uncopyable."""
    model = convert_to_fp8(qwen3_moe(), FP8Recipe(backend="emulated"))
    ids = torch.randint(0, 100, (1, 8))
    logits = model(ids).logits
    assert torch.equal(copy.deepcopy(model)(ids).logits, logits)


def test_expert_quantization_follows_in_place_weight_changes():
    """`load_state_dict` or an in-place edit changes the experts without an optimizer step: the cached codes and
    scales, and the transposed codes of the grouped dgrad, follow (they are keyed on the tensor's version)."""
    model = convert_to_fp8(qwen3_moe(), FP8Recipe(backend="emulated"))
    experts = model.model.layers[0].mlp.experts
    q, s, _ = (t.clone() for t in experts.quantized_with_t("down_proj"))
    with torch.no_grad():
        experts.down_proj.mul_(2)  # exact: the same codes under twice the scales
    q2, s2, _ = experts.quantized_with_t("down_proj")
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, 2 * s)
    with torch.no_grad():
        experts.down_proj.add_(torch.randn_like(experts.down_proj))
    q3, _, qt3 = experts.quantized_with_t("down_proj")
    assert not torch.equal(q3.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(qt3.view(torch.uint8), q3.transpose(1, 2).contiguous().view(torch.uint8))


def test_capture_routing_records_each_layers_expert_indices():
    model = qwen3_moe()
    with capture_routing(model) as routes:
        model(torch.randint(0, 100, (2, 5)))
    assert len(routes) == model.config.num_hidden_layers
    for route in routes:
        assert not route.is_floating_point() and route.shape == (10, model.config.num_experts_per_tok)
        assert 0 <= route.min() and route.max() < model.config.num_experts


def test_layer_ranges_kept_in_high_precision_cover_the_experts():
    for recipe, kept in ((FP8Recipe(num_first_layers_in_bf16=1), 0), (FP8Recipe(num_last_layers_in_bf16=1), 1)):
        model = convert_to_fp8(qwen3_moe(), recipe)
        assert [isinstance(layer.mlp.experts, FP8Experts) for layer in model.model.layers] == [kept != 0, kept != 1]


def test_experts_off_the_block_grid_stay_in_high_precision_with_a_warning():
    model = qwen3_moe()
    model.model.layers[1].mlp.experts.gate_up_proj.data = torch.randn(4, 256, 192)  # hidden 192: not whole blocks
    model.model.layers[1].mlp.experts.down_proj.data = torch.randn(4, 192, 128)
    with pytest.warns(
        UserWarning, match=r"model.layers.1.mlp.experts \(experts 128x192, not in whole 128x128 blocks\)"
    ):
        convert_to_fp8(model, FP8Recipe())
    assert isinstance(model.model.layers[0].mlp.experts, FP8Experts)
    assert not isinstance(model.model.layers[1].mlp.experts, FP8Experts)
    # On the grid, but a recipe with other weight blocks: the reason given is the block size (it said "not in whole
    # 128x128 blocks" of experts that are).
    with pytest.warns(UserWarning) as caught:
        model = convert_to_fp8(qwen3_moe(), FP8Recipe(weight_block_size=[64, 64]))
    message = "\n".join(str(w.message) for w in caught)
    assert "model.layers.0.mlp.experts (fused experts run with 128x128 weight blocks only, not [64, 64])" in message
    assert "not in whole" not in message and not any(isinstance(m, FP8Experts) for m in model.modules())


def _router_check(tmp_path, tokenizer):
    """A BF16 trainer of a tiny Qwen3-MoE with its sampler synced, and a padded batch as TRL hands it over."""
    args = tiny_grpo_args(tmp_path, fp8_training=False, fp8_generation=False)
    model = qwen3_moe(tokenizer)
    trainer = FP8GRPOTrainer(
        model=model, reward_funcs=digit_reward, args=args, train_dataset=make_dataset(16), processing_class=tokenizer
    )
    trainer.vllm_generation.sync_weights()
    prompt_mask, completion_mask = torch.tensor([[0, 0, 1], [1, 1, 1]]), torch.tensor([[1, 0, 0], [1, 1, 1]])
    mask = torch.cat([prompt_mask, completion_mask], dim=1)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]]).masked_fill(mask == 0, tokenizer.pad_token_id)
    output = {"prompt_ids": ids[:, :3], "completion_ids": ids[:, 3:], "prompt_mask": prompt_mask}
    output["completion_mask"] = completion_mask
    return trainer, model, output, ids, mask


def test_fp8_experts_take_the_recipes_pow2_scales():
    """The recipe's scale rule holds for fused experts as for linears: each expert quantized alone, pow2 scales."""
    model = convert_to_fp8(qwen3_moe(), FP8Recipe(pow2_scales=True))
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, FP8Experts)
    for which in ("gate_up_proj", "down_proj"):
        q, s = experts.quantized(which)
        w = getattr(experts, which).detach()
        for e in range(w.shape[0]):
            q_ref, s_ref = quantize_blockwise(w[e], (128, 128), pow2_scales=True)
            assert torch.equal(q[e].view(torch.uint8), q_ref.view(torch.uint8)), (which, e)
            assert torch.equal(s[e], s_ref), (which, e)


def test_router_mismatch_counts_real_tokens_only(tmp_path, demo_tokenizer):
    """`fp8/router_mismatch` is a share of (real token, MoE layer) pairs. With every router of the sampler negated,
    each real token goes to the other 2 of the 4 experts in both layers (1.0); some padded positions do not (their
    router logits tie), so counting padding would lower the figure."""
    trainer, model, output, ids, mask = _router_check(tmp_path, demo_tokenizer)
    engine = trainer.vllm_generation
    with torch.no_grad():
        for layer in engine.sampler.model.layers:
            layer.mlp.gate.weight.neg_()
    trainer._log_router_mismatch(output, "train")
    assert trainer._metrics["train"]["fp8/router_mismatch"] == [1.0]
    with torch.no_grad(), capture_routing(engine.sampler) as sampled, capture_routing(model) as learned:
        engine.sampler(input_ids=ids, attention_mask=mask)
        model(input_ids=ids, attention_mask=mask)
    padded = (mask == 0).flatten()
    assert not (sampled[0].sort(-1).values != learned[0].sort(-1).values).any(-1)[padded].all()


def test_router_mismatch_compares_the_experts_chosen_not_their_order(tmp_path, demo_tokenizer):
    """A sampler may list a token's top-k experts in another order (the expert sum does not depend on it): the same
    experts in reverse order are no mismatch."""
    trainer, model, output, ids, mask = _router_check(tmp_path, demo_tokenizer)

    def reverse_top_k(_module, args):
        hidden, top_k_index, top_k_weights = args
        return hidden, top_k_index.flip(-1), top_k_weights.flip(-1)

    experts = [m for m in trainer.vllm_generation.sampler.modules() if is_fused_experts(m)]
    handles = [m.register_forward_pre_hook(reverse_top_k) for m in experts]
    try:
        trainer._log_router_mismatch(output, "train")
        with (
            torch.no_grad(),
            capture_routing(trainer.vllm_generation.sampler) as sampled,
            capture_routing(model) as learned,
        ):
            trainer.vllm_generation.sampler(input_ids=ids, attention_mask=mask)
            model(input_ids=ids, attention_mask=mask)
    finally:
        for handle in handles:
            handle.remove()
    assert experts and (sampled[0] != learned[0]).any()  # the order differs...
    assert trainer._metrics["train"]["fp8/router_mismatch"] == [0.0]  # ...the experts do not


def test_routers_whose_linear_is_a_child_stay_in_high_precision():
    """Some routers hold their linear as a child: HunYuan-MoE's `mlp.gate.wg`, LongCat-Flash's
    `mlp.router.classifier` (768 outputs at its real size: whole 128-blocks). They stay in high precision as every
    router does; LongCat's reads `classifier.weight` itself, which the sampler held as raw E4M3 codes (router logits
    6000x too large, a sixth of the tokens routed elsewhere)."""
    import transformers
    from torch import nn

    torch.manual_seed(0)
    hunyuan = transformers.HunYuanMoEV1Config(
        vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, num_experts=128, moe_topk=2,
    )  # fmt: skip
    longcat = transformers.LongcatFlashConfig(
        vocab_size=128, hidden_size=256, num_layers=1, num_attention_heads=4, kv_lora_rank=128, q_lora_rank=128,
        qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64, ffn_hidden_size=256, expert_ffn_hidden_size=128,
        n_routed_experts=96, zero_expert_num=32, num_experts_per_tok=2,
    )  # fmt: skip
    hunyuan = transformers.HunYuanMoEV1ForCausalLM(hunyuan)
    longcat = transformers.LongcatFlashForCausalLM(longcat).eval()
    for model, router in ((hunyuan, "model.layers.0.mlp.gate.wg"), (longcat, "model.layers.0.mlp.router.classifier")):
        convert_to_fp8(model, FP8Recipe())
        assert type(model.get_submodule(router)) is nn.Linear, router
        assert any(isinstance(m, FP8Linear) for m in model.modules())
    sampler = build_sampler_model(longcat, FP8Recipe(), fp8=True, dtype=torch.float32)
    load_state_stream(sampler, iter_fp8_state(longcat))
    logits, ids = [], torch.randint(0, 128, (2, 16))
    for m in (longcat, sampler):
        hook = m.model.layers[0].mlp.router.register_forward_hook(lambda mod, args, out: logits.append(out[0]))
        with torch.no_grad():
            m(ids)
        hook.remove()
    # One router weight in both; its inputs come out of the learner's FP8 linears and the sampler's W8A8 ones.
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("move", ["half_float", "same_address"])
def test_moving_the_experts_drops_their_fp8_caches(move):

    model = convert_to_fp8(qwen3_moe(), FP8Recipe(backend="emulated"))
    experts = model.model.layers[0].mlp.experts
    experts.quantized_with_t("down_proj"), experts.quantized("gate_up_proj")
    MOVES[move](experts)
    assert experts._cache == {}
    for which in ("gate_up_proj", "down_proj"):
        w = getattr(experts, which).detach()
        q, s, qt = experts.quantized_with_t(which)
        q_ref, s_ref = quantize_blockwise(w.reshape(-1, w.shape[-1]), (128, 128))
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8).view(q.shape))
        assert torch.equal(s, s_ref.view(s.shape))
        assert torch.equal(qt.view(torch.uint8), q.transpose(1, 2).contiguous().view(torch.uint8))
