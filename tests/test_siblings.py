"""Sibling linears (q/k/v, gate/up) as one stacked FP8 GEMM: the same model, gradients and sync stream as running
each linear alone, on real tiny Llama and Qwen2 models (Qwen2 has q/k/v biases). Conversion stacks q/k/v; the tests
stack gate/up as well (`MLP_SIBLING_SETS`), so that groups of two and of three both run."""

import copy
import gc
import io
import statistics
import weakref

import pytest
import torch
from conftest import sqnr_db, tiny_config_kwargs, triton_marks
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from trl_fp8 import FP8Recipe, convert_to_fp8
from trl_fp8.quant import FP8Linear
from trl_fp8.quant.backends import emulated, torch_scaled_mm
from trl_fp8.quant.export import iter_fp8_state
from trl_fp8.quant.fp8_checkpoint import save_fp8_checkpoint
from trl_fp8.quant.siblings import MLP_SIBLING_SETS, FP8SiblingGroup, group_siblings


MODELS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}


def _pair(arch: str, backend: str = "emulated", **config):
    """The same random model converted twice: siblings stacked (q/k/v and gate/up), and each linear alone."""
    config_cls, model_cls = MODELS[arch]
    torch.manual_seed(0)
    base = model_cls(config_cls(**tiny_config_kwargs(**config)))
    if arch == "qwen2":  # random, non-zero biases
        for name, p in base.named_parameters():
            if name.endswith("bias"):
                torch.nn.init.normal_(p, std=0.5)
    fused = convert_to_fp8(copy.deepcopy(base), FP8Recipe(backend=backend))
    group_siblings(fused, MLP_SIBLING_SETS)
    alone = convert_to_fp8(copy.deepcopy(base), FP8Recipe(backend=backend, fuse_siblings=False))
    return fused, alone


def _step(model, ids):
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_stacked_siblings_are_the_same_model(arch):
    fused, alone = _pair(arch)
    groups = {id(m._siblings): m._siblings for m in fused.modules() if isinstance(m, FP8Linear) and m._siblings}
    names = sorted(tuple(m.fp8_name.rsplit(".", 2)[-2] for m in g.members) for g in groups.values())
    assert names == [("gate_proj", "up_proj")] * 3 + [("q_proj", "k_proj", "v_proj")] * 3
    assert all(m._siblings is None for m in alone.modules() if isinstance(m, FP8Linear))
    ids = torch.randint(0, 160, (2, 17), generator=torch.Generator().manual_seed(1))
    loss_f, grads_f = _step(fused, ids)
    loss_a, grads_a = _step(alone, ids)
    # The same FP8 operands; only fp32 summation orders differ (one dgrad over q|k|v instead of three added up). Such
    # last-bit differences in dX can move a few elements of the next layer down's dY quantization to the neighbouring
    # E4M3 value (a 2^-4 step), hence ~60 dB on gradients rather than > 100 (FP8 vs BF16 itself is ~30 dB).
    assert sqnr_db(loss_a, loss_f) > 100
    assert grads_f.keys() == grads_a.keys()
    assert min(sqnr_db(grads_a[n], grads_f[n]) for n in grads_a) > 50
    # What the sampler receives is bit for bit what each linear would have quantized alone.
    stream_f, stream_a = dict(iter_fp8_state(fused)), dict(iter_fp8_state(alone))
    assert stream_f.keys() == stream_a.keys()
    assert all(torch.equal(stream_f[n].view(torch.uint8), stream_a[n].view(torch.uint8)) for n in stream_a if
               stream_a[n].dtype == torch.float8_e4m3fn)  # fmt: skip
    assert all(torch.equal(stream_f[n], stream_a[n]) for n in stream_a if stream_a[n].dtype != torch.float8_e4m3fn)


def test_conversion_stacks_q_k_v_and_leaves_gate_up_contiguous():
    """By default only q/k/v stack: gate_proj's and up_proj's outputs are then whole tensors of their own, on which
    the model's SiLU and product run vectorized; stacked they would be column slices of one output."""
    torch.manual_seed(0)
    model = convert_to_fp8(LlamaForCausalLM(LlamaConfig(**tiny_config_kwargs(num_hidden_layers=1))), FP8Recipe())
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert [m.fp8_name.rsplit(".", 2)[-2] for m in attn.q_proj._siblings.members] == ["q_proj", "k_proj", "v_proj"]
    assert mlp.gate_proj._siblings is None and mlp.up_proj._siblings is None
    x = torch.randn(2, 5, 256)
    assert mlp.gate_proj(x).is_contiguous() and mlp.up_proj(x).is_contiguous()
    assert len(group_siblings(model, MLP_SIBLING_SETS)) == 1 and not mlp.gate_proj(x).is_contiguous()


def test_in_bf16_stacking_is_as_accurate_as_running_alone():
    """In a BF16 model the stacked dgrad rounds q|k|v's summed input gradient to BF16 once, where linears run alone
    round three and add them in BF16: dX differs by about an ulp, which moves later dY quantizations to neighbouring
    E4M3 values, so the two paths' gradients agree only at FP8's noise level (~25-30 dB, not the fp32 test's > 50).
    Neither is less accurate: both stay as close to the fp32, non-FP8 gradients."""
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**tiny_config_kwargs()))
    ids = torch.randint(0, 160, (2, 17), generator=torch.Generator().manual_seed(1))
    _, reference = _step(copy.deepcopy(base), ids)
    accuracy = {}
    for fuse in (True, False):
        model = convert_to_fp8(copy.deepcopy(base).to(torch.bfloat16), FP8Recipe(fuse_siblings=fuse))
        _, grads = _step(model, ids)
        accuracy[fuse] = statistics.median(sqnr_db(reference[n], grads[n].float()) for n in reference)
    assert accuracy[True] > accuracy[False] - 1.0 and accuracy[True] > 12, accuracy


def test_one_gemm_and_one_gradient_quantization_per_group(monkeypatch):
    calls = {"gemm": 0, "quantize_act": 0, "quantize_act_columns": 0}
    for name in calls:
        original = getattr(emulated, name)

        def spy(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(emulated, name, spy)
    fused, alone = _pair("llama", num_hidden_layers=1)
    ids = torch.randint(0, 160, (1, 9))
    per_layer = {}
    for label, model in (("fused", fused), ("alone", alone)):
        for name in calls:
            calls[name] = 0
        _step(model, ids)
        per_layer[label] = dict(calls)
    # Alone: 7 linears x (fprop + dgrad + wgrad) GEMMs; X quantized 4 times (q/k/v and gate/up share theirs), dY 7.
    assert per_layer["alone"] == {"gemm": 21, "quantize_act": 11, "quantize_act_columns": 0}
    # Stacked: q|k|v and gate|up run one fprop and one dgrad each, wgrad per linear; dY quantized once per group
    # (into its columns, member by member), o's and down's alone.
    assert per_layer["fused"] == {"gemm": 4 * 2 + 7, "quantize_act": 4 + 2, "quantize_act_columns": 2}


def test_any_call_order_and_input_is_right():
    fused, alone = _pair("llama", num_hidden_layers=1)
    attn_f, attn_a = fused.model.layers[0].self_attn, alone.model.layers[0].self_attn
    x, other = torch.randn(2, 5, 256), torch.randn(2, 5, 256)
    with torch.no_grad():
        got = [attn_f.k_proj(x), attn_f.v_proj(other), attn_f.q_proj(x), attn_f.v_proj(x), attn_f.k_proj(x)]
        want = [attn_a.k_proj(x), attn_a.v_proj(other), attn_a.q_proj(x), attn_a.v_proj(x), attn_a.k_proj(x)]
        x.mul_(2)  # in place: pending outputs for the old x must not be handed out
        got.append(attn_f.q_proj(x))
        want.append(attn_a.q_proj(x))
    assert all(sqnr_db(w, g) > 100 for w, g in zip(want, got, strict=True))


def test_nonfinite_sibling_is_named_and_copies_keep_their_own_groups(tmp_path):
    fused, _ = _pair("qwen2", num_hidden_layers=1)
    copied = copy.deepcopy(fused)
    group = copied.model.layers[0].self_attn.q_proj._siblings
    assert isinstance(group, FP8SiblingGroup) and group is not fused.model.layers[0].self_attn.q_proj._siblings
    assert group.members[1] is copied.model.layers[0].self_attn.k_proj
    ids = torch.randint(0, 160, (1, 9))
    assert torch.equal(copied(ids).logits, fused(ids).logits)
    # A checkpoint of stacked siblings (row views of one tensor, which safetensors refuses as such) saves.
    assert "model.layers.0.self_attn.k_proj.weight" in save_fp8_checkpoint(fused, str(tmp_path), fused.fp8_recipe)
    with torch.no_grad():
        copied.model.layers[0].self_attn.k_proj.weight[3, 3] = float("inf")
    copied(ids)  # the forward does not stop for the check
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.k_proj.weight'.*0 NaN, 1 inf"):
        copied.model.layers[0].self_attn.q_proj.quantized_weight()  # the culprit is named, not the stack


def _sm90() -> bool:
    return torch.cuda.is_available() and torch_scaled_mm.is_available(torch.device("cuda"))[0]


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an SM90 GPU with blockwise F.scaled_mm")
@pytest.mark.parametrize("tokens", [9, 300])  # one token block (size-1 scale dims) and three
def test_stacked_siblings_on_cublas(tokens):
    fused, alone = (m.cuda() for m in _pair("qwen2", backend="torch", num_hidden_layers=1))
    ids = torch.randint(0, 160, (1, tokens), device="cuda")
    loss_f, grads_f = _step(fused, ids)
    loss_a, grads_a = _step(alone, ids)
    assert sqnr_db(loss_a, loss_f) > 60
    assert min(sqnr_db(grads_a[n], grads_f[n]) for n in grads_a) > 40  # Hopper's MMA: 78 dB per GEMM, see conftest


@pytest.mark.parametrize("arch", [pytest.param("qwen2", marks=triton_marks())])
def test_stacked_siblings_on_the_triton_kernels(arch):
    """The fast path's padded operands (9 tokens: rows padded to 12, Xᵀ to 128) through the stacked GEMMs."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    fused, alone = _pair(arch, backend="triton", num_hidden_layers=1)
    fused, alone = fused.to(device), alone.to(device)
    ids = torch.randint(0, 160, (1, 9), device=device)
    loss_f, grads_f = _step(fused, ids)
    loss_a, grads_a = _step(alone, ids)
    assert sqnr_db(loss_a, loss_f) > 90
    assert min(sqnr_db(grads_a[n], grads_f[n]) for n in grads_a) > 50


@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing_recomputes_stacked_siblings(reentrant):
    """The GPU recipes train with gradient checkpointing: the recomputed forward (other input tensors, grad mode
    on) must stack the siblings again and give the gradients of a plain backward."""
    fused, _ = _pair("qwen2", num_hidden_layers=2)
    checkpointed = copy.deepcopy(fused)
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    checkpointed.train()
    fused.train()
    ids = torch.randint(0, 160, (2, 9), generator=torch.Generator().manual_seed(2))
    loss, grads = _step(fused, ids)
    loss_c, grads_c = _step(checkpointed, ids)
    assert torch.equal(loss, loss_c) and grads.keys() == grads_c.keys()
    assert all(torch.equal(grads[n], grads_c[n]) for n in grads)


def test_pending_outputs_go_stale_with_the_weights():
    fused, alone = _pair("llama", num_hidden_layers=1)
    attn_f, attn_a = fused.model.layers[0].self_attn, alone.model.layers[0].self_attn
    x = torch.randn(1, 3, 256)
    with torch.no_grad():
        attn_f.q_proj(x)  # k and v outputs now wait for their calls
        for attn in (attn_f, attn_a):
            attn.k_proj.weight.mul_(-1)
        assert sqnr_db(attn_a.k_proj(x), attn_f.k_proj(x)) > 100


def test_a_backward_through_one_sibling_leaves_the_others_computing_anew():
    """A backward through q's output frees the stacked GEMM's graph: k and v, called afterwards on the same x, must
    not be handed the outputs it made (their backward would fail), but compute and differentiate as alone."""
    fused, alone = _pair("llama", num_hidden_layers=1)
    grads = []
    for model in (fused, alone):
        attn = model.model.layers[0].self_attn
        x = torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(1), requires_grad=True)
        attn.q_proj(x).square().sum().backward()
        attn.k_proj(x).square().sum().backward()
        attn.v_proj(x).sum().backward()
        grads.append([x.grad, attn.k_proj.weight.grad, attn.v_proj.weight.grad])
    assert all(sqnr_db(a, f) > 50 for f, a in zip(*grads, strict=True))


def test_copies_pickles_and_replicas_after_a_forward():
    """After a forward (caches filled, backends resolved): a deepcopy and a `torch.save` round trip group their own
    members; a `DataParallel` replica (a shallow copy of each module) runs alone on its own weights; deleting the
    model frees it without waiting for Python's cycle collector."""
    fused, alone = _pair("qwen2", num_hidden_layers=1)
    ids = torch.randint(0, 160, (1, 9))
    logits = fused(ids).logits
    buffer = io.BytesIO()
    torch.save(fused, buffer)
    buffer.seek(0)
    for other in (copy.deepcopy(fused), torch.load(buffer, weights_only=False)):
        attn = other.model.layers[0].self_attn
        assert attn.q_proj._siblings.members == [attn.q_proj, attn.k_proj, attn.v_proj]
        assert torch.equal(other(ids).logits, logits)

    k_proj = fused.model.layers[0].self_attn.k_proj
    replica = k_proj._replicate_for_data_parallel()
    with torch.no_grad():
        # What `replicate()` then gives a replica: its own (broadcast) parameters.
        replica.weight, replica.bias = torch.nn.Parameter(k_proj.weight * -1), torch.nn.Parameter(k_proj.bias * 1)
        alone.model.layers[0].self_attn.k_proj.weight.mul_(-1)
    x = torch.randn(2, 256)
    assert replica._group() is None
    assert sqnr_db(alone.model.layers[0].self_attn.k_proj(x), replica(x)) > 100

    gc.disable()
    try:
        ref = weakref.ref(fused.model.layers[0].self_attn.q_proj)
        del fused, k_proj, replica, other, attn
        assert ref() is None
    finally:
        gc.enable()


def test_pending_outputs_go_stale_with_a_bias():
    fused, alone = _pair("qwen2", num_hidden_layers=1)
    attn_f, attn_a = fused.model.layers[0].self_attn, alone.model.layers[0].self_attn
    x = torch.randn(1, 3, 256)
    with torch.no_grad():
        attn_f.q_proj(x)
        for attn in (attn_f, attn_a):
            attn.k_proj.bias.add_(1)
        assert sqnr_db(attn_a.k_proj(x), attn_f.k_proj(x)) > 100


def test_group_refuses_members_it_cannot_stack_by_name():
    _, alone = _pair("llama", num_hidden_layers=1)
    attn, mlp = alone.model.layers[0].self_attn, alone.model.layers[0].mlp
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj.weight cannot join .*q_proj.weight's"):
        FP8SiblingGroup([attn.q_proj, mlp.down_proj])  # another in_features
    assert attn.q_proj._siblings is None  # nothing half-grouped
    # A member of 64 rows would share a 128-row weight block with its neighbour: stacked, its scales would not be its.
    half = FP8Linear.from_linear(
        torch.nn.Linear(256, 64, bias=False), backend=attn.q_proj.backend, name="model.layers.0.self_attn.k_half"
    )
    with pytest.raises(
        ValueError, match=r"model.layers.0.self_attn.k_half.weight has 64 rows, not whole 128-row blocks"
    ):
        FP8SiblingGroup([attn.q_proj, half])


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_copy_of_one_sibling_runs_alone_as_the_original_ran(how):
    """Copying one grouped linear copies its group, whose other members only the group references (weakly): once
    they are gone the copy runs alone, bit-equal to the stacked original."""
    fused, _ = _pair("qwen2", num_hidden_layers=1)
    q_proj = fused.model.layers[0].self_attn.q_proj
    x = torch.randn(3, 256, requires_grad=True)
    y = q_proj(x)
    (dx,) = torch.autograd.grad(y.square().sum(), x)
    if how == "deepcopy":
        lone = copy.deepcopy(q_proj)
    else:
        buffer = io.BytesIO()
        torch.save(q_proj, buffer)
        buffer.seek(0)
        lone = torch.load(buffer, weights_only=False)
    gc.collect()
    y_lone = lone(x)
    assert torch.equal(y_lone, y) and lone._group() is None
    assert torch.equal(torch.autograd.grad(y_lone.square().sum(), x)[0], dx)
    assert q_proj._group() is q_proj._siblings  # the original stays grouped


@pytest.mark.parametrize("backend", ["emulated", pytest.param("triton", marks=triton_marks())])
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "alone"])
def test_q_k_and_v_may_be_clamped_in_place_as_olmo_does(stacked, backend):
    """OLMo 1.7's `clip_qkv` clamps each of q, k and v with `clamp_`. Autograd forbids that on a view a custom
    Function made (each linear's output was one: the reshape, and Triton's padded rows dropped) and on one of several
    views one call returned (the stacked siblings' were); the gradients are those of clamping out of place, bit for
    bit."""
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton kernels run compiled there
    torch.manual_seed(0)
    members = [FP8Linear.from_linear(nn.Linear(256, n, device=device), backend=backend) for n in (256, 128, 128)]
    if stacked:
        FP8SiblingGroup(members)
    x0, c = torch.randn(3, 7, 256, device=device), 0.5  # 21 tokens: the Triton quantizer pads them to 24 rows
    gs = [torch.randn(3, 7, m.out_features, device=device) for m in members]

    def run(in_place: bool):
        x = x0.clone().requires_grad_(True)
        for m in members:
            m.weight.grad = m.bias.grad = None
        outs = [m(x) for m in members]
        outs = [o.clamp_(-c, c) if in_place else o.clamp(-c, c) for o in outs]
        sum((o * g).sum() for o, g in zip(outs, gs, strict=True)).backward()
        return outs, x.grad, [p.grad for m in members for p in (m.weight, m.bias)]

    outs, dx, grads = run(in_place=True)
    outs_ref, dx_ref, grads_ref = run(in_place=False)
    clipped = torch.cat([(o.abs() == c).flatten() for o in outs]).float().mean()
    assert 0.1 < clipped < 0.9  # the clamp decides part of every gradient
    assert all(torch.equal(o, r) for o, r in zip(outs, outs_ref, strict=True))
    assert torch.equal(dx, dx_ref)
    assert all(torch.equal(g, r) for g, r in zip(grads, grads_ref, strict=True))


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "alone"])
def test_one_siblings_output_changed_in_place_leaves_the_others_saved_for_backward_valid(stacked):
    """q scaled in place after k was saved for backward (by `k * k`): fine for separate linears, and so for stacked
    siblings, whose outputs share one GEMM's memory but not a version counter. The gradients are those of scaling q
    out of place, bit for bit."""
    torch.manual_seed(0)
    members = [FP8Linear.from_linear(nn.Linear(256, n), backend="emulated") for n in (256, 128, 128)]
    if stacked:
        FP8SiblingGroup(members)
    x0 = torch.randn(3, 256)

    def run(in_place: bool):
        x = x0.clone().requires_grad_(True)
        for m in members:
            m.weight.grad = m.bias.grad = None
        q, k, v = (m(x) for m in members)
        loss = (k * k).sum()
        q = q.mul_(0.5) if in_place else q * 0.5
        (loss + q.square().sum() + v.sum()).backward()
        return x.grad, [p.grad for m in members for p in (m.weight, m.bias)]

    dx, grads = run(in_place=True)
    dx_ref, grads_ref = run(in_place=False)
    assert torch.equal(dx, dx_ref)
    assert all(torch.equal(g, r) for g, r in zip(grads, grads_ref, strict=True))


def test_a_sibling_called_outside_the_autocast_its_siblings_ran_in_answers_in_its_own_dtype():
    """q under bf16 autocast, then k outside it on the same input: k is computed anew in fp32, not handed q's pending
    bf16 result."""
    torch.manual_seed(0)
    members = [FP8Linear.from_linear(nn.Linear(256, n), backend="emulated") for n in (256, 128)]
    k_alone = copy.deepcopy(members[1])
    FP8SiblingGroup(members)
    x = torch.randn(3, 256)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q = members[0](x)
    k = members[1](x)
    assert q.dtype == torch.bfloat16
    assert k.dtype == torch.float32 and torch.equal(k, k_alone(x))
