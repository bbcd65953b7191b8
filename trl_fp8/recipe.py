"""`FP8Recipe`: what is quantized and how. A flat, JSON-native value that can be saved, shared and reloaded."""

import json
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any


RECIPE_NAME = "fp8_recipe.json"


@dataclass
class FP8Recipe:
    r"""
    The FP8 recipe of DESIGN §1: E4M3 everywhere, 128x128 weight blocks, 1x128 activation and gradient blocks, fp32
    (or power-of-2) scales; attention, norms, embeddings, `lm_head` and MoE routers stay in high precision.

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
            GEMM backend of the learner: `"auto"` (fastest available), `"emulated"` (dequantize + fp32 matmul, any
            device), `"torch"` (`F.scaled_mm` blockwise, Hopper) or `"te"` (TransformerEngine).
        num_first_layers_in_bf16 (`int`, *optional*, defaults to `0`):
            Keep the linears of this many first decoder layers in high precision.
        num_last_layers_in_bf16 (`int`, *optional*, defaults to `0`):
            Keep the linears of this many last decoder layers in high precision.
        modules_to_not_convert (`list[str]`, *optional*, defaults to `[]`):
            Module name patterns kept in high precision: a pattern matches a module whose qualified name equals it,
            ends with `.pattern`, or contains it as a dotted component run (`"mlp.down_proj"`); `*` and `?` glob.
    """

    weight_block_size: list[int] = field(default_factory=lambda: [128, 128])
    activation_block_size: list[int] = field(default_factory=lambda: [1, 128])
    pow2_scales: bool = False
    backend: str = "auto"
    num_first_layers_in_bf16: int = 0
    num_last_layers_in_bf16: int = 0
    modules_to_not_convert: list[str] = field(default_factory=list)

    def __post_init__(self):
        from .quant.backends import BACKEND_NAMES

        self.weight_block_size = list(self.weight_block_size)
        self.activation_block_size = list(self.activation_block_size)
        self.modules_to_not_convert = list(self.modules_to_not_convert or [])
        if len(self.weight_block_size) != 2 or any(not isinstance(b, int) or b < 1 for b in self.weight_block_size):
            raise ValueError(f"FP8Recipe.weight_block_size must be two positive ints, got {self.weight_block_size}")
        if self.activation_block_size != [1, 128]:
            raise ValueError(
                f"FP8Recipe.activation_block_size must be [1, 128] (the only tile the GEMMs take), "
                f"got {self.activation_block_size}"
            )
        if self.backend not in BACKEND_NAMES:
            raise ValueError(f"FP8Recipe.backend must be one of {BACKEND_NAMES}, got {self.backend!r}")
        for name in ("num_first_layers_in_bf16", "num_last_layers_in_bf16"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"FP8Recipe.{name} must be a non-negative int, got {value!r}")
        if not isinstance(self.pow2_scales, bool):
            raise ValueError(f"FP8Recipe.pow2_scales must be a bool, got {self.pow2_scales!r}")
        if not all(isinstance(p, str) and p for p in self.modules_to_not_convert):
            raise ValueError(
                f"FP8Recipe.modules_to_not_convert must be non-empty strings, got {self.modules_to_not_convert}"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "FP8Recipe":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known - {"trl_fp8_version"})
        if unknown:
            raise ValueError(f"unknown FP8Recipe fields {unknown}; known fields are {sorted(known)}")
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def from_any(cls, value: "FP8Recipe | dict | str | os.PathLike | None") -> "FP8Recipe":
        """Accepts a recipe, a dict of its fields, a JSON file, or a folder holding `fp8_recipe.json`."""
        if value is None:
            return cls()
        if isinstance(value, FP8Recipe):
            return value
        if isinstance(value, dict):
            return cls.from_dict(value)
        path = os.fspath(value)
        if os.path.isdir(path):
            path = os.path.join(path, RECIPE_NAME)
        if not os.path.isfile(path):
            raise ValueError(f"fp8_recipe {value!r} is neither a recipe file nor a folder holding {RECIPE_NAME}")
        with open(path) as f:
            return cls.from_dict(json.load(f))
