"""The TensorRT-LLM checkpoint format: `config.json` plus `rank{N}.safetensors`.

Field names and defaults follow TensorRT-LLM's docs/source/architecture/checkpoint.md and
`PretrainedConfig.to_dict` (tensorrt_llm/models/modeling_utils.py); family-specific fields (rotary_*, attn_bias,
mlp_bias for Llama: tensorrt_llm/models/llama/config.py) live in the same flat object. This module is the one
place that reads and writes that format.

Checkpoints written by NVIDIA ModelOpt (`export_tensorrt_llm_checkpoint`, config `producer.name: modelopt`) are read
too (docs/conversion.md, "ModelOpt checkpoints"): their extra config fields are checked where they would change the
model (`check_family_fields`), and their separate K and V cache scales are merged as TensorRT-LLM merges them
(`kv_cache_scale`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from toolchain.checkpoint.hf import load_json
from toolchain.checkpoint.safetensors_io import NUMPY_DTYPES, read_header, read_tensor
from toolchain.checkpoint.safetensors_io import torch_dtype as torch_dtype_of
from toolchain.errors import UserError

if TYPE_CHECKING:
    import torch

CONFIG_NAME = "config.json"
# The checkpoint dtypes -> their safetensors codes.
DTYPES: dict[str, str] = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def rank_file(rank: int) -> str:
    return f"rank{rank}.safetensors"


@dataclass(frozen=True)
class Mapping:
    """How the model is split over GPUs; world_size = tp_size * pp_size (TensorRT-LLM's Mapping.to_dict
    fields that matter without context parallelism or MoE, at their defaults)."""

    world_size: int = 1
    tp_size: int = 1
    pp_size: int = 1
    cp_size: int = 1
    moe_tp_size: int = 1
    moe_ep_size: int = 1

    @classmethod
    def for_parallel(cls, tp: int, pp: int, moe_ep: int = 1) -> Mapping:
        """tp x pp ranks; a mixture of experts' tensors split over each tp group as moe_ep expert groups of
        moe_tp = tp / moe_ep ranks (TensorRT-LLM's rule moe_tp * moe_ep == tp; sharding.check_parallel refuses
        a moe_ep that does not divide tp)."""
        return cls(world_size=tp * pp, tp_size=tp, pp_size=pp, moe_tp_size=tp // moe_ep, moe_ep_size=moe_ep)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Mapping:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def rank(self, tp_rank: int, pp_rank: int) -> int:
        return pp_rank * self.tp_size + tp_rank

    def __post_init__(self) -> None:
        if self.world_size != self.tp_size * self.pp_size:
            raise UserError(f"mapping: world_size {self.world_size} != tp_size {self.tp_size} * pp_size {self.pp_size}")


@dataclass(frozen=True)
class QuantConfig:
    """The `quantization` object; all null/False for an unquantized checkpoint."""

    quant_algo: str | None = None
    kv_cache_quant_algo: str | None = None
    group_size: int = 128
    smoothquant_val: float = 0.5  # SmoothQuant's migration strength α (TensorRT-LLM's default)
    has_zero_point: bool = False
    pre_quant_scale: bool = False
    exclude_modules: list[str] | None = None


_POSITIVE_INTS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_size",
    "intermediate_size",
    "max_position_embeddings",
)


@dataclass(frozen=True)
class ModelConfig:
    """A TensorRT-LLM checkpoint config. `to_dict` is the exact JSON written to config.json."""

    architecture: str
    dtype: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_size: int
    intermediate_size: int
    hidden_act: str
    norm_epsilon: float
    max_position_embeddings: int
    position_embedding_type: str = "rope_gpt_neox"
    rotary_base: float = 10000.0
    rotary_scaling: dict[str, Any] | None = None
    logits_dtype: str = "float32"
    tie_word_embeddings: bool = False
    use_parallel_embedding: bool = False
    embedding_sharding_dim: int = 0
    share_embedding_table: bool = False
    attn_bias: bool = False
    mlp_bias: bool = False
    qk_layernorm: bool = False
    sliding_window: int | None = None
    mapping: Mapping = field(default_factory=Mapping)
    quantization: QuantConfig = field(default_factory=QuantConfig)
    # Family-specific fields (qwen_type, gpt_variant, bias, ...), written flat into config.json as
    # TensorRT-LLM does; unknown keys read from a config.json land here too, so nothing is lost.
    family_fields: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in _POSITIVE_INTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise UserError(f"'{name}' must be a positive integer, got {value!r}")
        if not isinstance(self.norm_epsilon, (int, float)) or not math.isfinite(self.norm_epsilon):
            raise UserError(f"'norm_epsilon' must be a finite number, got {self.norm_epsilon!r}")
        if self.dtype not in DTYPES:
            raise UserError(f"dtype {self.dtype!r} not supported; choose one of {', '.join(DTYPES)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise UserError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype_of(DTYPES[self.dtype])

    @property
    def numpy_dtype(self) -> np.dtype[Any]:
        return NUMPY_DTYPES[DTYPES[self.dtype]]

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        return {**data.pop("family_fields"), **data}

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = CONFIG_NAME) -> ModelConfig:
        known = {f.name for f in fields(cls)} - {"family_fields"}
        args: dict[str, Any] = {k: v for k, v in data.items() if k in known}
        args["family_fields"] = {k: v for k, v in data.items() if k not in known}
        try:
            args["mapping"] = Mapping.from_dict(data.get("mapping") or {})
            args["quantization"] = QuantConfig(**(data.get("quantization") or {}))
            return cls(**args)
        except TypeError as e:
            raise UserError(f"{source}: not a TensorRT-LLM checkpoint config ({e})") from e
        except UserError as e:
            raise UserError(f"{source}: {e}; the checkpoint config is damaged, re-run convert") from e


def write_config(directory: Path, config: ModelConfig) -> Path:
    path = directory / CONFIG_NAME
    path.write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    return path


def read_config(directory: Path) -> ModelConfig:
    """The config, and its model description checked once here so that an error names this file."""
    from toolchain.checkpoint.spec import spec_of  # spec.py builds on this module

    path = str(directory / CONFIG_NAME)
    cfg = ModelConfig.from_dict(load_json(directory / CONFIG_NAME), path)
    spec_of(cfg, path)
    return cfg


def load_rank(directory: Path, rank: int = 0) -> dict[str, torch.Tensor]:
    path = directory / rank_file(rank)
    if not path.is_file():
        raise UserError(f"{path} not found; is {directory} a converted checkpoint (trtbuild convert)?")
    # Our validating reader (positioned reads, as convert reads its inputs): a damaged file gets a one-line error
    # naming it instead of the library's exception, and no page of it is mapped into the process.
    infos, _ = read_header(path)
    with path.open("rb") as f:
        return {name: read_tensor(f, info) for name, info in infos.items()}


# Config fields other writers (ModelOpt) add whose values change the model: the value we implement. A checkpoint
# with another value is refused naming the field, never built as a different model.
_FIXED_FIELDS: dict[str, Any] = {"rotary_pct": 1.0, "residual_mlp": False}


def check_family_fields(cfg: ModelConfig, source: str = CONFIG_NAME) -> None:
    for name, supported in _FIXED_FIELDS.items():
        value = cfg.family_fields.get(name, supported)
        if value != supported:
            raise UserError(
                f"{source}: {name} {value!r} is not supported (only {supported!r}); this model cannot be built here"
            )


def kv_cache_scale(weights: dict[str, torch.Tensor], layer: str, source: str = "rank0.safetensors") -> float:
    """The dequantization factor of layer `layer`'s int8 / fp8 KV cache.

    One scale per layer, as TensorRT-LLM's attention plugin takes it (`Attention.kv_cache_scaling_factor`,
    tensorrt_llm/layers/attention.py). ModelOpt also writes `k_cache_scaling_factor` and `v_cache_scaling_factor`;
    TensorRT-LLM's loader merges them into `kv_cache_scaling_factor = max(k, v)` and drops them
    (`preprocess_weights` -> `process_kv_scaling_factor`, tensorrt_llm/models/modeling_utils.py), and so do we. A
    `kv_cache_scaling_factor` written beside them must be that max."""
    kv, k, v = kv_scale_names(layer)
    if (k in weights) != (v in weights):
        have, lack = (k, v) if k in weights else (v, k)
        raise UserError(f"{source}: {have} without {lack}; the K and V cache scales come as a pair")
    if k in weights:
        merged = max(_scalar(weights, k, source), _scalar(weights, v, source))
        if kv in weights and not math.isclose(_scalar(weights, kv, source), merged, rel_tol=1e-6):
            raise UserError(
                f"{source}: {kv} = {_scalar(weights, kv, source):g} but max({k.rsplit('.', 1)[1]}, "
                f"{v.rsplit('.', 1)[1]}) = {merged:g}; the checkpoint's KV cache scales disagree, re-export it"
            )
        return merged
    if kv not in weights:
        raise UserError(f"{source}: {kv} missing; the checkpoint's kv_cache_quant_algo needs one per layer")
    return _scalar(weights, kv, source)


def kv_scale_names(layer: str) -> tuple[str, str, str]:
    """The merged, K and V cache scale tensors of `layer`: every one `kv_cache_scale` may read."""
    kv, k, v = (f"{layer}.attention.{n}_cache_scaling_factor" for n in ("kv", "k", "v"))
    return kv, k, v


def _scalar(weights: dict[str, torch.Tensor], name: str, source: str) -> float:
    t = weights[name]
    if t.numel() != 1:
        raise UserError(f"{source}: {name} has shape {tuple(t.shape)}; expected one value per layer")
    value = float(t.reshape(-1)[0])
    if not math.isfinite(value) or value <= 0:
        raise UserError(f"{source}: {name} = {value}; a KV cache scale must be a positive finite number")
    return value
