"""`FP8Recipe`: what is quantized and how. A flat, JSON-native value that can be saved, shared and reloaded."""

import json
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from transformers.utils import PushToHubMixin


RECIPE_NAME = "fp8_recipe.json"


@dataclass
class FP8Recipe(PushToHubMixin):
    r"""
    The FP8 recipe (NeMo RL's, TransformerEngine's `Float8BlockScaling`): E4M3 everywhere, 128x128 weight blocks,
    1x128 activation and gradient blocks, fp32 (or power-of-2) scales; attention, norms, embeddings, `lm_head` and
    MoE routers stay in high precision.

    Parameters:
        weight_block_size (`list[int]`, *optional*, defaults to `[128, 128]`):
            Block of one weight scale, over (out_features, in_features). vLLM and DeepSeek-V3 checkpoints use
            `[128, 128]`; other sizes are for experiments and cannot be served by vLLM.
        activation_block_size (`list[int]`, *optional*, defaults to `[1, 128]`):
            Block of one activation / gradient scale, over (tokens, features). Only `[1, 128]` is supported by the
            GEMM backends.
        pow2_scales (`bool`, *optional*, defaults to `False`):
            Round scales down to powers of two (TransformerEngine's default, DeepGEMM's UE8M0, required on
            Blackwell). `False` keeps plain fp32 scales, as NeMo RL ships (`NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1`).
        backend (`str`, *optional*, defaults to `"auto"`):
            GEMM backend of the learner: `"auto"` (TE where it runs the recipe, else `torch`, else `triton`, else
            `emulated`; `emulated` for weight blocks other than 128x128), `"emulated"` (dequantize + fp32 matmul, any
            device), `"torch"` (`F.scaled_mm` blockwise, Hopper), `"triton"` (trl-fp8's Triton kernels, Hopper and
            newer) or `"te"` (TransformerEngine).
        num_first_layers_in_bf16 (`int`, *optional*, defaults to `0`):
            Keep the linears of this many first decoder layers in high precision.
        num_last_layers_in_bf16 (`int`, *optional*, defaults to `0`):
            Keep the linears of this many last decoder layers in high precision.
        modules_to_not_convert (`list[str]`, *optional*, defaults to `[]`):
            Module name patterns kept in high precision: a pattern matches a module whose qualified name equals it,
            ends with `.pattern`, or contains it as a dotted component run (`"mlp.down_proj"`); `*` and `?` glob.
        fuse_siblings (`bool`, *optional*, defaults to `True`):
            Run attention's q/k/v, which read one input, as one stacked FP8 GEMM per pass, as Megatron's fused
            `linear_qkv` does (`trl_fp8.quant.siblings`). Names, Parameters, checkpoints and the sync stream are
            unchanged, and so is every quantization; `False` runs each linear alone. A gated MLP's gate/up stay
            two GEMMs (`trl_fp8.quant.siblings.MLP_SIBLING_SETS` says why). Not used by the `te` backend.
    """

    weight_block_size: list[int] = field(default_factory=lambda: [128, 128])
    activation_block_size: list[int] = field(default_factory=lambda: [1, 128])
    pow2_scales: bool = False
    backend: str = "auto"
    num_first_layers_in_bf16: int = 0
    num_last_layers_in_bf16: int = 0
    modules_to_not_convert: list[str] = field(default_factory=list)
    fuse_siblings: bool = True

    def __post_init__(self):
        from .quant.backends import BACKEND_NAMES

        # A string (easy to write in YAML or on the command line) would pass list() one character at a time.
        for name in ("weight_block_size", "activation_block_size", "modules_to_not_convert"):
            value = getattr(self, name)
            if not isinstance(value, (list, tuple)) and (value is not None or name != "modules_to_not_convert"):
                raise ValueError(f"FP8Recipe.{name} must be a list, got {type(value).__name__} {value!r}")
        self.weight_block_size = list(self.weight_block_size)
        self.activation_block_size = list(self.activation_block_size)
        self.modules_to_not_convert = list(self.modules_to_not_convert or [])
        if len(self.weight_block_size) != 2 or any(type(b) is not int or b < 1 for b in self.weight_block_size):
            raise ValueError(f"FP8Recipe.weight_block_size must be two positive ints, got {self.weight_block_size}")
        if self.activation_block_size != [1, 128]:
            raise ValueError(
                f"FP8Recipe.activation_block_size must be [1, 128] (the only tile the GEMMs take), "
                f"got {self.activation_block_size}"
            )
        if self.backend not in BACKEND_NAMES:
            raise ValueError(f"FP8Recipe.backend must be one of {BACKEND_NAMES}, got {self.backend!r}")
        if self.backend in ("torch", "triton", "te") and self.weight_block_size != [128, 128]:
            raise ValueError(
                f"FP8Recipe.weight_block_size {self.weight_block_size} needs backend='emulated': the {self.backend!r} "
                "backend only has 128x128 weight blocks"
            )
        for name in ("num_first_layers_in_bf16", "num_last_layers_in_bf16"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"FP8Recipe.{name} must be a non-negative int, got {value!r}")
        for name in ("pow2_scales", "fuse_siblings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"FP8Recipe.{name} must be a bool, got {getattr(self, name)!r}")
        if not all(isinstance(p, str) and p for p in self.modules_to_not_convert):
            raise ValueError(
                f"FP8Recipe.modules_to_not_convert must be non-empty strings, got {self.modules_to_not_convert}"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs) -> str:
        """Writes `fp8_recipe.json` (with the writing `trl_fp8_version`) into `save_directory`; returns its path.
        `**kwargs` are accepted for `push_to_hub`, which passes its own."""
        from . import __version__

        if kwargs.get("push_to_hub"):  # transformers' save_pretrained would upload; this one writes only
            raise ValueError(
                "FP8Recipe.save_pretrained writes a local file; upload it with recipe.push_to_hub(repo_id)"
            )

        if os.path.isfile(save_directory):
            raise ValueError(f"save_directory {save_directory!r} is a file, expected a folder")
        os.makedirs(save_directory, exist_ok=True)
        path = os.path.join(save_directory, RECIPE_NAME)
        with open(path, "w") as f:
            f.write(json.dumps({**self.to_dict(), "trl_fp8_version": __version__}, indent=2, sort_keys=True) + "\n")
        return path

    @classmethod
    def from_pretrained(
        cls,
        pretrained_recipe_name_or_path: str | os.PathLike,
        *,
        subfolder: str | None = None,
        revision: str | None = None,
        token: str | bool | None = None,
        cache_dir: str | os.PathLike | None = None,
    ) -> "FP8Recipe":
        """Loads a recipe from a local folder or file, or from a Hub repository holding `fp8_recipe.json`."""
        path = os.fspath(pretrained_recipe_name_or_path)
        local = os.path.join(path, subfolder) if subfolder else path
        if os.path.isdir(local):
            local = os.path.join(local, RECIPE_NAME)
        if not os.path.isfile(local):
            from huggingface_hub import hf_hub_download

            try:
                local = hf_hub_download(
                    path, RECIPE_NAME, subfolder=subfolder, revision=revision, token=token, cache_dir=cache_dir
                )
            except Exception as exc:
                raise ValueError(
                    f"can't find '{RECIPE_NAME}' at '{path}' (a local folder or a Hub repository)"
                ) from exc
        with open(local) as f:
            try:
                data = json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ValueError(f"{local} is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError(f"{local} must hold a JSON object of FP8Recipe fields")
        return cls.from_dict(data)

    def to_quantization_config(self, modules_to_not_convert: list[str] | None = None) -> dict[str, Any]:
        """The `quantization_config` that vLLM (`Fp8Config`) and transformers (`FineGrainedFP8Config`) read for a
        checkpoint in this recipe's format; `modules_to_not_convert` lists the linears kept in high precision."""
        config = {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": list(self.weight_block_size),
        }
        if modules_to_not_convert:
            config["modules_to_not_convert"] = list(modules_to_not_convert)
        return config

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "FP8Recipe":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known - {"trl_fp8_version"})
        if unknown:
            raise ValueError(f"unknown FP8Recipe fields {unknown}; known fields are {sorted(known)}")
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def from_any(cls, value: "FP8Recipe | dict | str | os.PathLike | None") -> "FP8Recipe":
        """Accepts a recipe, a dict of its fields, a JSON file, a folder holding `fp8_recipe.json` or a Hub id. A new
        recipe every time: a recipe changed after it was handed over (its fields are not frozen) changes nothing."""
        if value is None:
            return cls()
        if isinstance(value, FP8Recipe):
            value = value.to_dict()  # validated again, as a dict would be
        if isinstance(value, dict):
            return cls.from_dict(value)
        if not isinstance(value, (str, os.PathLike)):
            raise ValueError(
                f"expected an FP8Recipe, a dict of its fields, or the path or Hub id of its fp8_recipe.json, got "
                f"{type(value).__name__} {value!r}"
            )
        return cls.from_pretrained(value)
