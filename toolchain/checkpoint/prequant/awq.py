"""AutoAWQ's GEMM checkpoints (`quant_method: "awq"`, `version: "gemm"`), read into the w4a16_gptq layout
(quantize/methods/w4a16_gptq.py: unsigned int4 codes with integer zero points): AWQ GEMM is asymmetric, so it is
not TensorRT-LLM's W4A16_AWQ (symmetric codes plus a pre_quant_scale) but the zero-point form.

The format (AutoAWQ 0.2.9 `WQLinear_GEMM.from_linear` / its packer, and the readers that unpack it — vLLM's
`awq_triton` / `AWQ_REVERSE_ORDER`, transformers' quantizer_awq.py with gptqmodel): config.json
`quantization_config` {quant_method "awq", version "gemm", bits 4, group_size G, zero_point true,
modules_to_not_convert}; per quantized linear PREFIX.qweight int32 [in, out/8] — eight 4-bit output columns a word,
word slot k (bits 4k..4k+3) holding column AWQ_ORDER[k] = (0, 2, 4, 6, 1, 3, 5, 7)[k] of its eight —
PREFIX.qzeros int32 [in/G, out/8] packed the same way, PREFIX.scales float16 [in/G, out]; w[o, i] =
(q[i, o] − z[i/G, o]) · s[i/G, o]. No act-order.

AutoAWQ's kernels are CUDA-only, so no producer runs here: tests/prequant/test_awq_gemm.py writes checkpoints to this
layout and checks what we read against an unpacking written independently from AWQ_REVERSE_ORDER.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from toolchain.checkpoint.hf import HFCheckpoint, TensorReader
from toolchain.checkpoint.prequant import Array, Made, file_of, hf_prefix, positive_scales
from toolchain.checkpoint.prequant.codecs import AWQ_ORDER, int4_rows_pack, unpack_int32
from toolchain.checkpoint.safetensors_io import TORCH_NAMES
from toolchain.checkpoint.sharding import Rule
from toolchain.checkpoint.trtllm import ModelConfig, QuantConfig
from toolchain.errors import UserError

FLOAT = ("F32", "F16", "BF16")


class AwqGemm:
    """An AutoAWQ GEMM checkpoint (prequant.Format)."""

    name = "awq"

    def __init__(self, ckpt: HFCheckpoint, q: dict[str, Any], source: str) -> None:
        self.warnings: list[str] = []
        self.ckpt, self.file, self.settings = ckpt, source, q
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm":
            raise UserError(
                f"{source}: AutoAWQ version {version!r}; trtbuild reads the GEMM packing (version gemm) only. "
                "Re-export with version gemm"
            )
        if q.get("bits", q.get("w_bit")) != 4:
            raise UserError(f"{source}: AutoAWQ bits {q.get('bits', q.get('w_bit'))!r}; only 4 is read")
        if not q.get("zero_point", True):
            raise UserError(f"{source}: AutoAWQ zero_point false; the GEMM layout read here has zero points")
        g = q.get("group_size", q.get("q_group_size"))
        if not isinstance(g, int) or g <= 0:
            raise UserError(f"{source}: AutoAWQ group_size {g!r}; a positive group size is read (not per-channel -1)")
        self.group = g
        experts = sorted(n for n in ckpt.tensors if ".experts." in n and n.endswith(".qweight"))
        if experts:
            raise UserError(f"{ckpt.root}: quantized experts in an AWQ checkpoint ({experts[0]}, ...): not yet")

    def quantization(self) -> QuantConfig:
        return QuantConfig(quant_algo="W4A16_GPTQ", group_size=self.group, has_zero_point=True)

    def source(self) -> dict[str, Any]:
        return {
            "format": self.name,
            "quant_method": "awq",
            "producer": "AutoAWQ GEMM layout",
            "version": self.settings.get("version", "gemm"),
            "quant_algo": "W4A16_GPTQ",
            "file": self.file,
            "settings": self.settings,
        }

    def extras(self, cfg: ModelConfig) -> list[Made]:
        return []

    def linear(self, rule: Rule) -> list[Made] | None:
        prefixes = [hf_prefix(s) for s in rule.srcs]
        quantized = [f"{p}.qweight" in self.ckpt.tensors for p in prefixes]
        if not any(quantized):
            return None
        if not all(quantized) or rule.transpose or rule.offset or rule.halves_swapped:
            raise UserError(
                f"{self.ckpt.root}: {rule.dst} fuses {', '.join(prefixes)}, of which only some are quantized; the "
                "parts of one GEMM are quantized together"
            )
        g, outs, width = self.group, [], None
        for p in prefixes:
            qw, qz, sc = (self._need(f"{p}.{n}") for n in ("qweight", "qzeros", "scales"))
            inn, packed = self._shape2(qw, "I32")
            out = packed * 8
            if inn % g:
                raise UserError(f"{file_of(self.ckpt, qw)}: {qw} has {inn} input rows, not whole groups of {g}")
            if out % 2:
                raise UserError(f"{file_of(self.ckpt, qw)}: {qw} has {out} output columns; int4 rows pack in pairs")
            self._expect(qz, (inn // g, packed), ("I32",))
            self._expect(sc, (inn // g, out), FLOAT)
            if width is not None and inn != width:
                raise UserError(f"{self.ckpt.root}: {', '.join(prefixes)} disagree in input width")
            outs.append(out)
            width = inn
        assert width is not None
        rows, dst = sum(outs), rule.dst.removesuffix(".weight")
        srcs = {n: tuple(f"{p}.{n}" for p in prefixes) for n in ("qweight", "qzeros", "scales")}
        per_group = (rows, width // g)
        return [
            Made(f"{dst}.weight", (rows // 2, width), "uint8", srcs["qweight"], _codes(srcs["qweight"])),
            Made(f"{dst}.weights_scaling_factor", per_group, "float32", srcs["scales"], _scales(srcs["scales"])),
            Made(f"{dst}.weights_zero_point", per_group, "uint8", srcs["qzeros"], _zeros(srcs["qzeros"])),
        ]

    def _need(self, name: str) -> str:
        if name not in self.ckpt.tensors:
            raise UserError(f"{self.ckpt.root}: {name} missing; an AWQ GEMM linear stores qweight, qzeros and scales")
        return name

    def _shape2(self, name: str, code: str) -> tuple[int, int]:
        info = self.ckpt.tensors[name]
        if info.code != code or len(info.shape) != 2:
            raise UserError(
                f"{file_of(self.ckpt, name)}: tensor {name} is {TORCH_NAMES[info.code]}{list(info.shape)}; AWQ GEMM "
                f"stores {TORCH_NAMES[code]} [in, out/8]"
            )
        return int(info.shape[0]), int(info.shape[1])

    def _expect(self, name: str, shape: tuple[int, int], codes: tuple[str, ...]) -> None:
        info = self.ckpt.tensors[name]
        if tuple(info.shape) != shape or info.code not in codes:
            raise UserError(
                f"{file_of(self.ckpt, name)}: tensor {name} is {TORCH_NAMES[info.code]}{list(info.shape)}; its qweight "
                f"implies {'/'.join(TORCH_NAMES[c] for c in codes)} {list(shape)}"
            )


def _unpacked(reader: TensorReader, names: tuple[str, ...]) -> Array:
    """The int4 fields of AWQ-packed int32 tensors [rows, out/8] -> [out total, rows] (output channels first)."""
    parts = [unpack_int32(reader.get(n), 4, axis=1, order=AWQ_ORDER) for n in names]
    joined: Array = np.concatenate(parts, axis=1).T
    return joined


def _codes(names: tuple[str, ...]) -> Any:
    def make(reader: TensorReader) -> Array:
        return np.ascontiguousarray(int4_rows_pack(_unpacked(reader, names)))

    return make


def _zeros(names: tuple[str, ...]) -> Any:
    def make(reader: TensorReader) -> Array:
        return np.ascontiguousarray(_unpacked(reader, names).astype(np.uint8))

    return make


def _scales(names: tuple[str, ...]) -> Any:
    def make(reader: TensorReader) -> Array:
        parts = []
        for n in names:
            parts.append(positive_scales(reader, n))  # float32 holds every float16 / bfloat16 scale exactly
        return np.ascontiguousarray(np.concatenate(parts, axis=1).T)

    return make
