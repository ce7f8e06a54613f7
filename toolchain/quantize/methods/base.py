"""What every quantization method is: the `QuantMethod` interface the quantize stage's layer-by-layer driver, the
fake-quant reference and the ONNX export call, and the data they hand it.

A method owns the tensors of the linears it quantizes: it names them (`tensor_names`), makes them of one float
linear PREFIX.weight [out, in] (`plan`, `quantize`), reads them back as a float weight (`dequantize`, the
reference) and adds their ONNX nodes (`export`, the engine graph) — no other module reads a quantized linear's
tensors. TensorRT-LLM's names are the suffixes below; every quantized linear carries PREFIX.weights_scaling_factor,
whatever its method, and that is how a checkpoint's quantized linears are found (`quantized`). Work that needs a
whole layer — SmoothQuant's smoothing, AWQ's searches, FP8's fc/gate shared scale — is its `prepare`, run once per
layer before the layer's linears are quantized; a `streamable` method needs none of it, so the driver quantizes
each linear as the writer reaches it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from toolchain.checkpoint.safetensors_io import TensorInfo
from toolchain.checkpoint.spec import LayerSpec
from toolchain.quantize.calibrate import Calibration
from toolchain.quantize.methods import GROUP_SIZES, METHODS_INDEX
from toolchain.quantize.smoothquant import Alpha

if TYPE_CHECKING:  # the quantize stage need not import onnx
    from onnx import TensorProto

# TensorRT-LLM's tensor names of a quantized linear PREFIX: PREFIX.<suffix>
WEIGHT = "weight"  # the codes
WEIGHT_SCALE = "weights_scaling_factor"  # every quantized linear has one: it marks the linear as quantized
ACTIVATION_SCALE = "activation_scaling_factor"  # a static per-tensor scale of the input
PREQUANT = "prequant_scaling_factor"  # 1/s [in], multiplying the input before anything else (SmoothQuant, AWQ)
# Two-level scales (NVFP4's float32 global scale, W4A8's FP8 stage): TensorRT-LLM's second weight scale. It
# multiplies, as ModelOpt's `weight_scale_2` and TensorRT-LLM's `weights_global_scaling_factor` do
# (compressed-tensors' `*_global_scale` divides: its reader stores the reciprocal).
WEIGHT_SCALE_2 = "weights_scaling_factor_2"
# Integer zero points (GPTQ, AWQ GEMM, asymmetric compressed-tensors): uint8 [out, in / G], w = (q - z) * s. Ours,
# not TensorRT-LLM's `zero` (a pre-scaled float [in / G, out]): an ONNX DequantizeLinear takes these as its zero
# point unchanged.
ZERO_POINT = "weights_zero_point"
# Act-order (GPTQ desc_act): int64 [in], the input columns in the order the stored weight's columns are in, so its
# groups are contiguous: the engine reads x[..., input_perm] (a Gather) and a blocked DequantizeLinear stays exact.
INPUT_PERM = "input_perm"
# Per-projection scales of a fused GEMM (q/k/v into attention.qkv; issue 28: requantizing them to the largest costs
# KLD 0.02): int64 [parts], the output rows of each part in order. Where present, a method's per-tensor scales
# (weights_scaling_factor / _2, activation_scaling_factor) hold one value per part, and the input is quantized
# with each part's own scale for that part's rows.
PARTS = "parts"


def quantized(prefix: str, tensors: Mapping[str, torch.Tensor]) -> bool:
    """Whether linear PREFIX of a checkpoint is stored quantized (`in` is not a read of the tensor)."""
    return f"{prefix}.{WEIGHT_SCALE}" in tensors


def quantized_prefix(name: str) -> str | None:
    """The linear whose quantization tensor `name` marks (PREFIX.weights_scaling_factor), else None."""
    return name.removesuffix(f".{WEIGHT_SCALE}") if name.endswith(f".{WEIGHT_SCALE}") else None


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


@dataclass(frozen=True)
class Stored:
    """One quantized linear PREFIX of a checkpoint, as its method reads it back: the checkpoint's tensors (the method
    reads its own names among them), the linear's input width and config.json's group size."""

    prefix: str
    tensors: Mapping[str, torch.Tensor]
    in_features: int
    group_size: int

    def name(self, suffix: str) -> str:
        return f"{self.prefix}.{suffix}"

    def __getitem__(self, suffix: str) -> torch.Tensor:
        return self.tensors[self.name(suffix)]

    def get(self, suffix: str) -> torch.Tensor | None:
        """PREFIX.<suffix> where the checkpoint has it (only then read), else None."""
        return self[suffix] if self.name(suffix) in self.tensors else None

    def weight_scale(self) -> torch.Tensor:
        """The weight scales as float32, as the reference and the graph compute with them."""
        return self[WEIGHT_SCALE].float()


@dataclass(frozen=True)
class InputScales:
    """What the engine does to a quantized linear's input at run time, as stored: multiply by `prequant` (1/s, in
    the checkpoint dtype), then quantize-dequantize at the static per-tensor `activation` scale [1] (the method's
    activation_kind)."""

    prequant: torch.Tensor | None = None
    activation: torch.Tensor | None = None


class GraphBuilder(Protocol):
    """The part of the ONNX exporter's builder (engine/export.py) a method's `export` uses."""

    def has(self, name: str) -> bool: ...

    def add_initializer(self, proto: TensorProto) -> str:
        """Add a ready-made initializer (e.g. int4 codes, core.int4_proto); returns its name."""
        ...

    def const(self, name: str, t: torch.Tensor) -> str: ...

    def float_const(self, name: str, t: torch.Tensor) -> str:
        """A constant in the engine dtype."""
        ...

    def op(self, op: str, inputs: list[str], name: str, **attrs: Any) -> str: ...


def per_row(s: Stored, values: torch.Tensor, rows: int) -> torch.Tensor:
    """A per-tensor scale [1], or one per part [parts] where the linear has PREFIX.parts (a fused GEMM's
    per-projection scales), as a float32 column [rows, 1] over the output rows."""
    parts = s.get(PARTS)
    values = values.float().reshape(-1)
    if parts is None:
        return values.expand(rows).reshape(rows, 1)
    return torch.repeat_interleave(values, parts.long()).reshape(rows, 1)


def info(name: str, dtype: torch.dtype, *shape: int) -> dict[str, TensorInfo]:
    return {name: TensorInfo(name, dtype, tuple(shape))}


def zero_point(b: GraphBuilder, kind: str) -> str:
    """The graph's one zero point of activation kind "INT8" / "FP8" (symmetric: 0), added on first use."""
    name = f"zero_point_{kind.lower()}"
    if not b.has(name):
        b.const(name, torch.zeros((), dtype=torch.int8 if kind == "INT8" else torch.float8_e4m3fn))
    return name


class QuantMethod:
    """One weight quantization method. Class attributes describe it; the registry (registry.py) holds one instance
    of each, by CLI name (methods/__init__.py) and by config.json's `quant_algo`.

    The input side (`input_scales`, `export_input`) is TensorRT-LLM's for every method here: the stored
    prequant_scaling_factor where `pre_quant_scale`, a static activation_scaling_factor where `activation_kind`. A
    method that quantizes its input otherwise (NVFP4's dynamic blocks) overrides them."""

    quant_algo: ClassVar[str]  # config.json's quantization.quant_algo (TensorRT-LLM's QuantAlgo)
    suffixes: ClassVar[tuple[str, ...]]  # the tensors PREFIX.<suffix> of a linear it quantizes (some may be absent)
    needs_calibration: ClassVar[bool] = False
    streamable: ClassVar[bool] = True  # quantize needs the weight alone: no `prepare`, no calibration statistics
    activation_kind: ClassVar[str | None] = None  # "INT8" / "FP8": activations quantized per tensor at run time
    pre_quant_scale: ClassVar[bool] = False  # config.json's pre_quant_scale: linears may carry 1/s for the input
    details_key: ClassVar[str | None] = None  # the manifest key of `prepare`'s per-linear choices (their summary())
    uses_sq_alpha: ClassVar[bool] = False  # reads Context.sq_alpha (the manifest records it)
    grouped: ClassVar[bool] = False  # weight scales per group of input channels (config.json's group_size applies)

    def __init__(self, name: str) -> None:
        self.name = name  # `--method`, a recipe's `quantize.method` (methods/__init__.py)
        entry = METHODS_INDEX.get(name)  # its line there declares the group sizes it accepts
        self.group_sizes: tuple[int, ...] = entry.group_sizes if entry else GROUP_SIZES

    def tensor_names(self, prefix: str) -> tuple[str, ...]:
        """Every tensor a linear PREFIX quantized by this method may carry; the method reads no other."""
        return tuple(f"{prefix}.{suffix}" for suffix in self.suffixes)

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

    def dequantize(self, s: Stored) -> torch.Tensor:
        """The float weight [out, in_features] of the stored linear."""
        raise NotImplementedError

    def input_scales(self, s: Stored) -> InputScales:
        """What the engine applies to the stored linear's input at run time (the reference fake-quantizes it)."""
        return InputScales(
            s.get(PREQUANT) if self.pre_quant_scale else None,
            s.get(ACTIVATION_SCALE) if self.activation_kind else None,
        )

    def export(self, b: GraphBuilder, s: Stored, x: str) -> tuple[str, str]:
        """Add the stored linear's nodes to the graph, for input `x`; returns what its GEMM reads: the input (in the
        engine dtype) and the float32 weight [out, in_features]."""
        return self.export_input(b, s, x), self.export_weight(b, s)

    def export_input(self, b: GraphBuilder, s: Stored, x: str) -> str:
        """`input_scales` in the graph: a Mul by the prequant scale, a QuantizeLinear / DequantizeLinear pair."""
        scales, p = self.input_scales(s), s.prefix
        if scales.prequant is not None:
            x = b.op("Mul", [x, b.float_const(s.name(PREQUANT), scales.prequant)], f"{p}.input_prequant")
        if scales.activation is not None and self.activation_kind:
            scale = b.float_const(s.name(ACTIVATION_SCALE), scales.activation.reshape(()))
            q = b.op("QuantizeLinear", [x, scale, zero_point(b, self.activation_kind)], f"{p}.input_q")
            x = b.op("DequantizeLinear", [q, scale], f"{p}.input_dq")
        return x

    def export_weight(self, b: GraphBuilder, s: Stored) -> str:
        """The weight's DequantizeLinear pattern; returns its float32 output's name."""
        raise NotImplementedError

    def export_gemm(self, b: GraphBuilder, s: Stored, x: str) -> str | None:
        """The whole linear y = x · wᵀ (no bias) where one input and one weight cannot say it (a fused GEMM whose
        parts quantize their input each with its own scale: one Q/DQ + Gemm per part, then Concat); None: the
        default, `export`'s input and weight into one Gemm."""
        return None

    def fake_linear(self, s: Stored, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """The reference of a linear whose input treatment `input_scales` cannot say (dynamic per-token or per-block
        activation quantization, per-part scales): y = what the engine computes from x and the dequantized
        `weight` [out, in], without bias. None (the default): the reference applies `input_scales` itself."""
        return None
