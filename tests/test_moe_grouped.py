"""The grouped MoE fast path against the per-expert path, on the same FP8 backend (Triton: compiled on a GPU, its CPU
interpreter otherwise), and the grouped kernels against the `emulated` oracle on the same FP8 operands."""

import copy

import pytest
import torch
from conftest import ACCUMULATION_DB, TMA_FAILS_ON_GPU, HostSyncs, sqnr_db, triton_marks

from trl_fp8 import FP8Recipe, convert_to_fp8, iter_fp8_state
from trl_fp8.demo.tiny_moe import tiny_deepseek_v3, tiny_qwen3_moe
from trl_fp8.quant import quantize_blockwise
from trl_fp8.quant.backends import emulated
from trl_fp8.quant.convert import mark_sharded
from trl_fp8.quant.moe import FP8Experts
from trl_fp8.quant.moe_grouped import group_by_expert


pytestmark = triton_marks()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_group_by_expert_layout():
    top_k = torch.tensor([[2, 0], [2, 1], [0, 4], [2, 0]])  # expert 4 == num_experts: a dropped pair
    g = group_by_expert(top_k, num_experts=4)
    # Sized for the worst case without a host sync: 8 pairs + 127 rows for each of 4 experts and the dropped ones.
    assert g.rows == (8 + 127 * 5) // 128 * 128 == 5 * 128
    assert g.segments.tolist() == [0, 1, 2, 3, 3]  # expert 3 has no tokens; the dropped pair's tile starts at 3
    assert g.tile_expert.tolist() == [0, 1, 2, 4, 4]  # 4: no expert (zero outputs)
    by_row = {int(r): (int(t), int(p)) for r, t, p in zip(g.dest, g.token, g.pos, strict=True)}
    assert by_row == {0: (0, 1), 1: (2, 0), 2: (3, 1), 128: (1, 1), 256: (0, 0), 257: (1, 0), 258: (3, 0), 384: (2, 1)}
    beyond = top_k.clone()
    beyond[2, 1] = 7  # any index past the experts is a dropped pair too, never an out-of-bounds write
    assert all(torch.equal(a, b) for a, b in zip(g[:5], group_by_expert(beyond, num_experts=4)[:5], strict=True))


def test_grouped_gemm_gives_tiles_of_no_expert_zeros():
    """Tiles of no expert (index E) hold dropped pairs, whose rows are real hidden states: their outputs are zeros,
    computed with no expert's weights."""
    from trl_fp8.quant.backends.triton_gemm_kernels import grouped_gemm

    torch.manual_seed(0)
    xq, xs = quantize_blockwise(torch.randn(256, 128, device=DEVICE), (1, 128))
    wq, ws = quantize_blockwise(torch.randn(2, 128, 128, device=DEVICE), (128, 128))
    tile_expert = torch.tensor([0, 2], dtype=torch.int32, device=DEVICE)  # rows 0-127: expert 0; 128-255: none
    y = grouped_gemm(xq, xs, wq, ws, tile_expert, torch.float32)
    assert not y[128:].any()
    assert (
        sqnr_db(emulated.gemm(xq[:128], xs[:128], wq[0], ws[0], (128, 128), torch.float32), y[:128]) > ACCUMULATION_DB
    )


def test_grouping_never_waits_for_the_gpu():
    """Sizing the buffer exactly took two host syncs per MoE layer and pass (each stalls the queue of kernels)."""
    top_k = torch.randint(0, 9, (300, 2))  # 9 == num_experts: dropped pairs
    with HostSyncs() as counter:
        g = group_by_expert(top_k, num_experts=8)
    assert counter.count == 0, counter.ops
    # Routers may hand int32 indices: the same grouping.
    assert all(torch.equal(a, b) for a, b in zip(g[:5], group_by_expert(top_k.int(), num_experts=8)[:5], strict=True))


def test_all_experts_quantize_in_one_launch_exactly_as_each_alone():
    """FP8Experts quantizes all experts as one stacked (E * N, K) matrix (one kernel launch): every expert's rows are
    whole 128-row blocks, so codes and scales are each expert's own (codes bit for bit where the kernel is compiled:
    Triton's CPU interpreter rounds to E4M3 its own way, see tests/test_triton_kernels.py)."""
    model = tiny_qwen3_moe().to(DEVICE)
    convert_to_fp8(model, FP8Recipe(backend="triton"))
    experts = next(m for m in model.modules() if isinstance(m, FP8Experts))
    for which in ("gate_up_proj", "down_proj"):
        q, s = experts.quantized(which)
        for e in range(experts.num_experts):
            q_ref, s_ref = quantize_blockwise(getattr(experts, which)[e].detach(), (128, 128))
            assert torch.equal(s[e], s_ref), (which, e)
            if DEVICE == "cuda":
                assert torch.equal(q[e].view(torch.uint8), q_ref.view(torch.uint8)), (which, e)


def test_experts_wt_comes_with_the_weights_quantization_and_is_made_when_first_asked():
    """The grouped dgrad's per-expert Wᵀ: on a GPU the forward's quantization writes it (one pass, cached with the
    codes); where it did not (here on CPU, or after the export's `quantized()`), the first `quantized_with_t` makes it
    rather than hand the dgrad nothing. Either way it is each expert's codes transposed, once per step."""
    model = tiny_qwen3_moe().to(DEVICE)
    convert_to_fp8(model, FP8Recipe(backend="triton"))
    experts = next(m for m in model.modules() if isinstance(m, FP8Experts))
    for which in ("gate_up_proj", "down_proj"):
        q, s = experts.quantized(which)
        assert (experts._cache[which][3] is None) == (DEVICE == "cpu")
        q2, s2, qt = experts.quantized_with_t(which)
        assert q2 is q and s2 is s and qt.is_contiguous()
        assert torch.equal(qt.view(torch.uint8), q.transpose(1, 2).view(torch.uint8))
        assert experts.quantized_with_t(which)[2] is qt  # cached


def _quantized_operands(m_per_expert, k, n):
    """A buffer of 128-aligned expert segments (zero rows between), its experts' weights, all quantized."""
    torch.manual_seed(0)
    top_k = torch.cat([torch.full((m, 1), e) for e, m in enumerate(m_per_expert)])
    g = group_by_expert(top_k, len(m_per_expert))
    x = torch.zeros(g.rows, k).index_copy(0, g.dest, torch.randn(len(top_k), k)[g.token]).to(DEVICE)
    w = torch.randn(len(m_per_expert), n, k, device=DEVICE)
    return g, x, w


# `tma`: the autotuner's pick (the plain kernel in the interpreter), or the warp-specialized TMA kernel, which reads
# B as one (E * N, K) matrix: with N = 208, a tile's rows past N are the next expert's, to be masked at the store.
@pytest.mark.parametrize("n", [384, 208])
@pytest.mark.parametrize("tma", [None, pytest.param(True, marks=TMA_FAILS_ON_GPU)], ids=["tuned", "tma"])
def test_grouped_kernels_match_the_oracle_expert_by_expert(tma, n, monkeypatch):
    from trl_fp8.quant.backends.triton_gemm_kernels import grouped_gemm, grouped_wgrad

    if tma:
        monkeypatch.setenv("TRL_FP8_TRITON_TMA", "1")
    g, x, w = _quantized_operands([130, 0, 60], k=256, n=n)
    dy = torch.randn(g.rows, n, device=DEVICE) * (x.abs().sum(1, keepdim=True) > 0)
    xq, xs = quantize_blockwise(x, (1, 128))
    wq, ws = quantize_blockwise(w, (128, 128))
    tile_expert, segments = g.tile_expert.to(DEVICE), g.segments.to(DEVICE)
    y = grouped_gemm(xq, xs, wq, ws, tile_expert, torch.float32, tma=tma)
    dyq, dys = quantize_blockwise(dy, (1, 128))
    wqt, wst = wq.transpose(1, 2), ws.transpose(1, 2)
    dx = grouped_gemm(dyq, dys, wqt, wst, tile_expert, torch.float32, tma=tma)
    dytq, dyts = quantize_blockwise(dy.t(), (1, 128))
    xtq, xts = quantize_blockwise(x.t(), (1, 128))
    if tma:  # row-major, as the fused quantizer writes them (the reference keeps the transposed views' layout)
        dytq, xtq = dytq.contiguous(), xtq.contiguous()
    dw = grouped_wgrad(dytq, dyts, xtq, xts, segments, 3, torch.float32, tma=tma)
    for e in range(3):
        rows = slice(int(g.segments[e]) * 128, int(g.segments[e + 1]) * 128)
        if rows.start == rows.stop:
            assert torch.equal(dw[e], torch.zeros_like(dw[e]))  # an expert without tokens gets no gradient
            continue
        blocks = slice(rows.start // 128, rows.stop // 128)
        assert sqnr_db(emulated.gemm(xq[rows], xs[rows], wq[e], ws[e], (128, 128), torch.float32), y[rows]) > (
            ACCUMULATION_DB
        )  # (inf where they agree bit for bit)
        ref_dx = emulated.gemm(dyq[rows], dys[rows], wqt[e], wst[e], (128, 128), torch.float32)
        ref_dw = emulated.gemm(dytq[:, rows], dyts[:, blocks], xtq[:, rows], xts[:, blocks], (1, 128), torch.float32)
        assert sqnr_db(ref_dx, dx[rows]) > ACCUMULATION_DB and sqnr_db(ref_dw, dw[e]) > ACCUMULATION_DB


def test_grouped_kernels_refuse_tma_for_operands_it_cannot_read(monkeypatch):
    """K = 200 bytes between rows: TMA cannot read them, and forcing it is an error giving the strides."""
    from trl_fp8.quant.backends.triton_gemm_kernels import grouped_gemm, grouped_wgrad

    monkeypatch.setenv("TRL_FP8_TRITON_TMA", "1")  # switched on, as on a GPU it must be: the operands are the reason

    a = torch.zeros(128, 200, dtype=torch.float8_e4m3fn, device=DEVICE)
    b = torch.zeros(2, 128, 200, dtype=torch.float8_e4m3fn, device=DEVICE)
    tile_expert = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"TMA cannot read these operands \(A strides \(200, 1\), B strides"):
        grouped_gemm(a, torch.ones(128, 2, device=DEVICE), b, torch.ones(2, 1, 2, device=DEVICE), tile_expert,
                     torch.float32, tma=True)  # fmt: skip
    at = torch.zeros(128, 200, dtype=torch.float8_e4m3fn, device=DEVICE)  # 200 tokens apart
    segments = torch.tensor([0, 1, 1], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"A strides \(200, 1\), B strides \(200, 1\)"):
        grouped_wgrad(at, torch.ones(128, 2, device=DEVICE), at, torch.ones(128, 2, device=DEVICE), segments, 2,
                      torch.float32, tma=True)  # fmt: skip


def _tune_kernels(experts, x, top_k_index, top_k_weights):
    """On a GPU, the first call of an autotuned Triton kernel benchmarks its configs, syncing the host on the way:
    one forward+backward of a copy (its own weights, so the module under test still quantizes its own) tunes them
    before syncs are counted. The CPU interpreter does not autotune."""
    if DEVICE == "cuda":
        twin = copy.deepcopy(experts)
        twin(x.clone().requires_grad_(), top_k_index, top_k_weights).float().square().sum().backward()


@pytest.mark.parametrize("build", [tiny_qwen3_moe, tiny_deepseek_v3])
def test_grouped_experts_match_the_per_expert_path(build):
    """Forward, input gradient and both fused weight gradients of a whole MoE layer, grouped vs looped over experts
    on the same backend: identical quantization, so only the summation order differs."""
    model = build().to(DEVICE)
    convert_to_fp8(model, FP8Recipe(backend="triton"))
    experts = next(m for m in model.modules() if isinstance(m, FP8Experts))
    looped = copy.deepcopy(experts)
    torch.manual_seed(1)
    tokens, hidden = 200, experts.gate_up_proj.shape[-1]
    x = torch.randn(tokens, hidden, device=DEVICE)
    # Index num_experts: a dropped pair (capacity-limited routers), which both paths skip.
    top_k_index = torch.randint(0, experts.num_experts + 1, (tokens, 2), device=DEVICE)
    top_k_weights = torch.rand(tokens, 2, device=DEVICE)
    top_k_weights[top_k_index == experts.num_experts] = float("inf")  # a dropped pair's weight counts for nothing
    _tune_kernels(experts, x, top_k_index, top_k_weights)
    outputs, syncs = [], []
    for module, run in ((experts, experts.forward), (looped, looped.forward_per_expert)):
        xi = x.clone().requires_grad_()
        with HostSyncs() as counter:
            y = run(xi, top_k_index, top_k_weights)
            y.square().sum().backward()
        syncs.append(counter.count)
        outputs.append((y, xi.grad, module.gate_up_proj.grad, module.down_proj.grad))
    # Grouped: no host sync in the whole step (weights quantized too); the loop syncs once per expert it visits.
    assert syncs[0] == 0 and syncs[1] > experts.num_experts
    for (got, ref), what in zip(zip(*outputs, strict=True), ("y", "dx", "d gate_up", "d down"), strict=True):
        assert sqnr_db(ref, got) > ACCUMULATION_DB - 10, what  # -10: two chained FP8 layers, requantized between


@pytest.mark.parametrize("path", ["grouped", "per_expert"])
def test_sharded_experts_quantize_again_for_the_backward(path):
    """Experts whose weights FSDP2 shards (`mark_sharded`) keep no FP8 copy of them, neither cached nor saved for the
    backward, which quantizes them again (from the weights FSDP gathers again): the layer's output and every
    gradient are bit for bit those of the cached path."""
    model = tiny_qwen3_moe().to(DEVICE)
    convert_to_fp8(model, FP8Recipe(backend="triton"))
    experts = next(m for m in model.modules() if isinstance(m, FP8Experts))
    sharded = copy.deepcopy(experts)
    mark_sharded(sharded)
    torch.manual_seed(1)
    x = torch.randn(200, experts.gate_up_proj.shape[-1], device=DEVICE)
    top_k_index = torch.randint(0, experts.num_experts, (200, 2), device=DEVICE)
    top_k_weights = torch.rand(200, 2, device=DEVICE)
    outputs, fp8_saved = [], []
    for module in (experts, sharded):
        saved = []

        def pack(t, saved=saved):
            saved.append((t.dtype, t.dim()))
            return t

        xi = x.clone().requires_grad_()
        run = module.forward if path == "grouped" else module.forward_per_expert
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = run(xi, top_k_index, top_k_weights)
        y.square().sum().backward()
        outputs.append((y, xi.grad, module.gate_up_proj.grad, module.down_proj.grad))
        fp8_saved.append(sum(dtype == torch.float8_e4m3fn and dim >= 2 for dtype, dim in saved))
    for got, ref in zip(*outputs, strict=True):
        assert torch.equal(got, ref)
    # The cached path keeps each weight's FP8 transpose for its dgrad (the loop: a view per expert and GEMM); the
    # sharded one only the activations' FP8 codes (X for wgrad).
    assert fp8_saved[1] > 0 and fp8_saved[0] == 2 * fp8_saved[1], fp8_saved
    assert not sharded._cache and experts._cache


def test_a_nan_expert_weight_costs_no_sync_in_training_and_is_refused_at_export():
    """As FP8Linear: the finiteness check waits for the next export (every sampler sync), which names the weight."""
    model = tiny_qwen3_moe().to(DEVICE)
    convert_to_fp8(model, FP8Recipe(backend="triton"))
    experts = next(m for m in model.modules() if isinstance(m, FP8Experts))
    with torch.no_grad():
        experts.down_proj[1, 5, 7] = float("nan")
    x = torch.randn(64, experts.gate_up_proj.shape[-1], device=DEVICE)
    top_k_index = torch.randint(0, experts.num_experts, (64, 2), device=DEVICE)
    top_k_weights = torch.rand(64, 2, device=DEVICE)
    _tune_kernels(experts, x, top_k_index, top_k_weights)
    with HostSyncs() as counter:
        experts(x, top_k_index, top_k_weights)
    assert counter.count == 0
    with pytest.raises(ValueError, match=rf"'{experts.fp8_name}.down_proj'.*1 of .* not finite \(1 NaN"):
        dict(iter_fp8_state(model))


@pytest.mark.parametrize("path", ["grouped", "per_expert"])
def test_experts_train_after_a_forward_in_inference_mode(path):
    """A forward under `torch.inference_mode()` (an eval or a `generate()`) filled the experts' FP8 weight cache with
    inference tensors, which the next training step's autograd refused to save: it failed. It now trains as a copy
    that never ran in inference mode does, bit for bit."""
    model = tiny_qwen3_moe().to(DEVICE)
    convert_to_fp8(model, FP8Recipe(backend="triton"))
    experts = next(m for m in model.modules() if isinstance(m, FP8Experts))
    fresh = copy.deepcopy(experts)
    torch.manual_seed(1)
    x = torch.randn(64, experts.gate_up_proj.shape[-1], device=DEVICE)
    top_k_index = torch.randint(0, experts.num_experts, (64, 2), device=DEVICE)
    top_k_weights = torch.rand(64, 2, device=DEVICE)
    run = (lambda m: m.forward) if path == "grouped" else (lambda m: m.forward_per_expert)
    with torch.inference_mode():
        run(experts)(x, top_k_index, top_k_weights)
    assert experts._cache  # what the training step reuses
    grads = []
    for module in (experts, fresh):
        xi = x.clone().requires_grad_()
        run(module)(xi, top_k_index, top_k_weights).square().sum().backward()
        grads.append((xi.grad, module.gate_up_proj.grad, module.down_proj.grad))
    for got, ref in zip(*grads, strict=True):
        assert torch.equal(got, ref)
