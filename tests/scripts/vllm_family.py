"""Run by tests/test_vllm_end_to_end.py (vLLM only), one family per process: a tiny random model of a
`trl_fp8.demo.families` family, saved with the demo tokenizer, trained two FP8 GRPO steps (with a reference model:
beta > 0) with colocated vLLM in block FP8; the checks' raw material in `<output_dir>/result.json`. On vLLM's CPU build
the block-FP8 kernels are stood in for as in tests/scripts/vllm_two_steps.py.

    python tests/scripts/vllm_family.py FAMILY OUTPUT_DIR      # FAMILY:tied ties its lm_head to its embeddings
                                                               # FAMILY:fp8_kv_cache samples with the FP8 KV cache
                                                               # gemma3:multimodal: Gemma3ForConditionalGeneration
"""

import importlib
import importlib.util
import json
import os
import sys

import torch
from transformers import AutoTokenizer
from vllm_two_steps import _emulate_vllm_fp8_kernels_on_cpu, _storages  # this folder: the script's own sys.path[0]

from trl_fp8 import FP8GRPOConfig, FP8GRPOTrainer
from trl_fp8.demo.families import tiny, varied_reward
from trl_fp8.demo.task import DEMO_MODEL_DIR, make_dataset


def _held(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of vLLM's model and, for the linears whose weight vLLM's CPU build moved into a kernel of its
    own (unquantized ones: `.weight` left empty), their output on a fixed input, which shows what they hold."""
    held = {n: p.detach().clone().cpu() for n, p in model.named_parameters() if p.numel() > 0}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.numel() == 0 and hasattr(module, "input_size"):
            x = torch.linspace(-1, 1, module.input_size, dtype=weight.dtype).unsqueeze(0)
            out = module(x)
            held[f"{name}(x)"] = (out[0] if isinstance(out, tuple) else out).detach().clone().cpu()
    return held


def _kv_scales(model: torch.nn.Module) -> dict[str, list[float]]:
    """Each attention layer's K and V dequant multipliers as vLLM's kernels read them (`_k_scale`, `_v_scale`)."""
    return {n: [float(m._k_scale), float(m._v_scale)] for n, m in model.named_modules() if hasattr(m, "_k_scale")}


def _params(engine) -> dict[str, torch.Tensor]:
    return engine.llm.apply_model(_held)[0]


_TORCHVISION_STUB = '''"""An empty torchvision: every attribute and submodule an empty module (tests/scripts/vllm_family.py)."""
import importlib
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0+stub"


class _Empty(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return importlib.import_module(f"{self.__name__}.{name}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        return _Empty(spec.name)

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return importlib.import_module(f"torchvision.{name}")
'''


def _stub_torchvision(output_dir: str) -> None:
    """vLLM's Qwen3.5 classes import transformers' Qwen2-VL image processor, which imports torchvision at module level;
    PyPI's torchvision is built for torch's CUDA build and does not load on its CPU build. A text policy never runs
    any of it, so on CPU those imports get empty modules: the one stand-in besides the FP8 kernels. It is a package on
    PYTHONPATH, as vLLM inspects a model class in a subprocess of its own (unless its cache of model infos, under
    VLLM_CACHE_ROOT, already holds the class: a fresh machine's does not)."""
    stub = os.path.join(output_dir, "torchvision_stub")
    os.makedirs(os.path.join(stub, "torchvision"), exist_ok=True)
    with open(os.path.join(stub, "torchvision", "__init__.py"), "w") as f:
        f.write(_TORCHVISION_STUB)
    sys.path.insert(0, stub)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [stub, os.environ.get("PYTHONPATH")]))


def _multimodal(text_model: torch.nn.Module) -> torch.nn.Module:
    """Gemma 3 (4B and up) as `AutoModelForCausalLM` loads it: `Gemma3ForConditionalGeneration`, the tiny text model's
    config beside a tiny SigLIP vision tower (its linears stay in high precision: only the text decoder converts)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = text_model.config.to_dict()
    vision = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                  patch_size=8)  # fmt: skip
    ids = {k: text[k] for k in ("pad_token_id", "bos_token_id", "eos_token_id")}
    torch.manual_seed(0)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, boi_token_index=100,
                          eoi_token_index=101, image_token_index=102, **ids)  # fmt: skip
    return Gemma3ForConditionalGeneration(config)


def main(family: str, output_dir: str) -> None:
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        _emulate_vllm_fp8_kernels_on_cpu()
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if family.startswith(("qwen3_5", "gemma3:multimodal")) and importlib.util.find_spec("torchvision") is None:
            _stub_torchvision(output_dir)
    family, _, option = family.partition(":")
    tied = option == "tied"
    model_dir = os.path.join(output_dir, family)
    policy = tiny(family, **({"tie_word_embeddings": True} if tied else {}))
    if option == "multimodal":
        policy = _multimodal(policy)
    policy.save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(DEMO_MODEL_DIR).save_pretrained(model_dir)
    # Text prompts to a multimodal class: vLLM builds its language model alone (no images, so no image processor,
    # which TRL would otherwise load too); the stream still carries the vision tower, which vLLM's loader skips.
    mm = {"limit_mm_per_prompt": {"image": 0}} if option == "multimodal" else {}
    args = FP8GRPOConfig(
        output_dir, use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3, bf16=True,
        use_cpu=not on_gpu, per_device_train_batch_size=8, num_generations=4, max_completion_length=8, max_steps=2,
        report_to="none", logging_steps=1, save_strategy="no", disable_tqdm=True, beta=0.04,
        vllm_llm_kwargs={"enforce_eager": True, **mm}, fp8_kv_cache=option == "fp8_kv_cache",
        # Gemma 4's K=V full-attention layer (and the KV-shared one after it) in BF16: vLLM's qkv_proj there holds
        # q_proj and k_proj, k_proj twice, and must find all three names in ignored_layers.
        fp8_recipe={"num_last_layers_in_bf16": 2} if option == "last_layers_bf16" else None,
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trainer = FP8GRPOTrainer(model_dir, reward_funcs=varied_reward, args=args, train_dataset=make_dataset(64),
                             processing_class=tokenizer)  # fmt: skip
    engine = trainer.vllm_generation
    dummy = _params(engine)  # `load_format="dummy"`: random values until the first refit
    trainer.train()
    synced = _params(engine)
    storages = _storages(engine)
    for _ in range(3):
        engine.sync_weights()
    key = "sampling/token_mult_prob_error"
    result = {
        "errors": [log[key] for log in trainer.state.log_history if key in log],
        "params": len(synced),  # with the repacked linears' outputs
        "not_written": sorted(n for n, t in synced.items() if torch.equal(t, dummy[n])),
        "in_place": _storages(engine) == storages,
        "kv_scales": engine.llm.apply_model(_kv_scales)[0] if args.fp8_kv_cache else {},
    }
    with open(os.path.join(output_dir, "result.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
