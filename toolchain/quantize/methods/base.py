"""What every quantization method is: the `QuantMethod` interface the quantize stage's layer-by-layer driver, the
fake-quant reference and the ONNX export call, and the data they hand it.

A method turns one float linear PREFIX.weight [out, in] into the tensors TensorRT-LLM stores for its `quant_algo`
(scheme.py lists the layouts), reads them back as a float weight (the reference), and says how the engine graph
dequantizes them (a DequantizeLinear pattern). Work that needs a whole layer — SmoothQuant's smoothing, AWQ's
searches, FP8's fc/gate shared scale — is its `prepare`, run once per layer before the layer's linears are
quantized; a `streamable` method needs none of it, so the driver quantizes each linear as the writer reaches it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from toolchain.checkpoint.safetensors_io import TensorInfo
from toolchain.checkpoint.spec import LayerSpec
from toolchain.quantize.calibrate import Calibration
from toolchain.quantize.smoothquant import Alpha

if TYPE_CHECKING:  # the quantize stage need not import onnx
    from onnx import TensorProto


@dataclass(frozen=True)
class Context:
    """What a method may read besides the weight: the settings and the calibration statistics so far."""

    group_size: int = 128
    dtype: torch.dtype = torch.float32  # the checkpoint's: a `prequant_scaling_factor` is stored in it
    sq_alpha: Alpha = 0.5  # w8a8_sq's migration strength, or "auto"
    calib: Calibration = field(default_factory=Calibration)


@dataclass
class Layer:
    """One unit quantized together: decoder layer `name` (`spec` its LayerSpec) or lm_head (`spec` None); its
    float tensors, which `prepare` may rewrite or add to; the linears of it to quantize; every chosen linear."""

    name: str
    tensors: dict[str, torch.Tensor]
    linears: list[str]
    chosen: set[str]
    spec: LayerSpec | None = None  # a decoder layer's description


class GraphBuilder(Protocol):
    """The part of the ONNX exporter's builder (engine/export.py) a method's `export` uses."""

    def add_initializer(self, proto: TensorProto) -> str:
        """Add a ready-made initializer (e.g. int4 codes, core.int4_proto); returns its name."""
        ...

    def const(self, name: str, t: torch.Tensor) -> str: ...

    def op(self, op: str, inputs: list[str], name: str, **attrs: Any) -> str: ...


def info(name: str, dtype: torch.dtype, *shape: int) -> dict[str, TensorInfo]:
    return {name: TensorInfo(name, dtype, tuple(shape))}


class QuantMethod:
    """One weight quantization method. Class attributes describe it; the registry (registry.py) holds one instance
    of each, by CLI name (methods/__init__.py) and by config.json's `quant_algo`."""

    quant_algo: ClassVar[str]  # config.json's quantization.quant_algo (TensorRT-LLM's QuantAlgo)
    needs_calibration: ClassVar[bool] = False
    streamable: ClassVar[bool] = True  # quantize needs the weight alone: no `prepare`, no calibration statistics
    activation_kind: ClassVar[str | None] = None  # "INT8" / "FP8": activations quantized per tensor at run time
    pre_quant_scale: ClassVar[bool] = False  # config.json's pre_quant_scale: linears may carry 1/s for the input
    details_key: ClassVar[str | None] = None  # the manifest key of `prepare`'s per-linear choices (their summary())
    uses_sq_alpha: ClassVar[bool] = False  # reads Context.sq_alpha (the manifest records it)
    grouped: ClassVar[bool] = False  # weight scales per group of input channels (config.json's group_size applies)

    def __init__(self, name: str) -> None:
        self.name = name  # `--method`, a recipe's `quantize.method` (methods/__init__.py)

    def plan(self, prefix: str, shape: tuple[int, ...], ctx: Context) -> dict[str, TensorInfo]:
        """The tensors `quantize` makes of PREFIX.weight of `shape`, without computing them."""
        raise NotImplementedError

    def prepare(self, layer: Layer, ctx: Context) -> dict[str, Any]:
        """Per-layer work before its linears are quantized; returns what `quantize` takes per linear."""
        return {}

    def quantize(
        self, prefix: str, weight: torch.Tensor, ctx: Context, prepared: Any = None
    ) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def dequantize(self, codes: torch.Tensor, scale: torch.Tensor, in_features: int) -> torch.Tensor:
        """The float weight [out, in_features] of stored codes and float32 weight scales."""
        raise NotImplementedError

    def export(
        self, b: GraphBuilder, prefix: str, codes: torch.Tensor, scale: torch.Tensor, in_features: int, group_size: int
    ) -> str:
        """Add the weight's DequantizeLinear pattern to the graph; returns its float32 output's name."""
        raise NotImplementedError
