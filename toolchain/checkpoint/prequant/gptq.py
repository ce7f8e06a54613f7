"""GPTQ checkpoints (`quant_method: gptq`, gptqmodel's and AutoGPTQ's format) read into W4A16_GPTQ
(methods/w4a16_gptq.py) without a float detour. Every fact below is from gptqmodel 7.7.0's own source.

quantization_config: `bits`, `group_size`, `desc_act`, `sym`, `checkpoint_format` ("gptq" = v1, "gptq_v2"),
`pack_dtype` (int32). Per linear PREFIX (nn_modules/qlinear/__init__.py `BaseQuantLinear.dequantize_weight`,
`_dequantize_from_codes`):
- `qweight` int32 [in / 8, out]: input row 8i + j in bits 4j..4j+3 of word row i (the first row in the lowest bits);
- `qzeros` int32 [groups, out / 8]: output column 8c + j in bits 4j of word column c;
- `scales` float16 [groups, out]; `g_idx` int32 [in], the group of each input row;
- w[k, o] = scales[g_idx[k], o] · (q[k, o] − z[g_idx[k], o]) (the weight as [in, out]).
v1 checkpoints store the zeros minus 1; gptqmodel reads them by adding 0x11111111 to each whole int32 word of
`qzeros` (utils/model.py `convert_gptq_v1_to_v2_format_module`: "v1 checkpoint format used to do `qzeros -= 1`
before serialization"; a nibble that was 15 carries into the next one, which gptqmodel accepts, "overflow ~<=13%"):
we do the same word addition (wrapping), so we read what gptqmodel computes.

Ours: codes [out, in] as w4a16_gptq's unsigned rows, scales and zeros transposed to [out, groups]. With act-order
(`desc_act`, g_idx not sorted) the input columns are stored sorted by group (a stable sort of g_idx) with that
order as PREFIX.input_perm, so each group is G contiguous columns. Only 4-bit, int32-packed, grouped checkpoints
are read; the rest is refused by name.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from toolchain.checkpoint.hf import HFCheckpoint, TensorReader
from toolchain.checkpoint.prequant import Array, Made, hf_prefix, positive_scales
from toolchain.checkpoint.prequant.codecs import int4_rows_pack, unpack_int32
from toolchain.checkpoint.sharding import Rule
from toolchain.checkpoint.trtllm import ModelConfig, QuantConfig
from toolchain.errors import UserError
from toolchain.quantize.methods.base import INPUT_PERM, WEIGHT, WEIGHT_SCALE, ZERO_POINT

BITS = 4
FORMATS = {"gptq": 1, "gptq_v2": 2}
V1_ZERO_FIX = 0x11111111  # one added to each of the word's eight 4-bit zeros, as one int32 addition


class Gptq:
    """A GPTQ checkpoint: 4-bit weights in groups with integer zero points, optionally in act-order."""

    name = "gptq"

    def __init__(self, ckpt: HFCheckpoint, q: dict[str, Any], source: str) -> None:
        self.warnings: list[str] = []
        self.ckpt, self.q, self.where = ckpt, q, source
        bits = q.get("bits")
        if bits != BITS:
            raise UserError(f"{source}: GPTQ bits {bits!r}: only 4-bit GPTQ is read (W4A16_GPTQ)")
        fmt = q.get("checkpoint_format", q.get("format", "gptq"))
        if not isinstance(fmt, str) or fmt not in FORMATS:
            raise UserError(f"{source}: GPTQ checkpoint_format {fmt!r} is not read; supported: {', '.join(FORMATS)}")
        self.version = FORMATS[fmt]
        pack = str(q.get("pack_dtype", "int32")).removeprefix("torch.")
        if pack != "int32":
            raise UserError(f"{source}: GPTQ pack_dtype {pack!r}: only int32 words are read")
        group = q.get("group_size")
        if not isinstance(group, int) or group <= 0:
            raise UserError(
                f"{source}: GPTQ group_size {group!r}: only grouped checkpoints are read (per channel, -1: not yet)"
            )
        self.group_size = group
        experts = sorted(n for n in ckpt.tensors if ".experts." in n and n.endswith(".qweight"))
        if experts:
            raise UserError(f"{source}: experts in GPTQ ({experts[0]}, ...): not yet read")

    def quantization(self) -> QuantConfig:
        return QuantConfig(quant_algo="W4A16_GPTQ", group_size=self.group_size, has_zero_point=True)

    def source(self) -> dict[str, Any]:
        meta = self.q.get("meta") if isinstance(self.q.get("meta"), dict) else {}
        return {
            "format": self.name,
            "quant_method": "gptq",
            "producer": (meta or {}).get("quantizer", "gptq"),
            "version": self.version,
            "quant_algo": "W4A16_GPTQ",
            "settings": {k: self.q.get(k) for k in ("bits", "group_size", "desc_act", "sym", "checkpoint_format")},
        }

    def extras(self, cfg: ModelConfig) -> list[Made]:
        return []

    def _shape(self, name: str, shape: tuple[int, ...], dtype: str) -> None:
        info = self.ckpt.tensors.get(name)
        if info is None:
            raise UserError(f"{self.where}: {name} is missing (GPTQ needs it); re-export the checkpoint")
        if tuple(info.shape) != shape:
            raise UserError(f"{self.where}: {name} has shape {list(info.shape)}, expected {list(shape)}")
        if dtype and info.numpy_dtype.name != dtype:
            raise UserError(f"{self.where}: {name} is {info.numpy_dtype.name}, GPTQ writes {dtype}")

    def linear(self, rule: Rule) -> list[Made] | None:
        hf = [hf_prefix(s) for s in rule.srcs]
        found = [f"{p}.qweight" in self.ckpt.tensors for p in hf]
        if not any(found):
            return None
        if not all(found):
            raise UserError(
                f"{self.where}: {', '.join(hf)} are fused into {rule.dst} but only some are quantized; re-export"
            )
        if rule.transpose or rule.offset or rule.halves_swapped or rule.packing:
            raise UserError(f"{self.where}: {rule.dst}: a quantized {rule.srcs[0]} needs a transform we do not apply")
        prefix = rule.dst.removesuffix(".weight")
        g = self.group_size
        words = [self.ckpt.tensors[f"{p}.qweight"].shape for p in hf]
        if any(len(w) != 2 for w in words):
            raise UserError(f"{self.where}: {', '.join(hf)}: qweight shapes {words}; GPTQ stores [in / 8, out] int32")
        in_dim = words[0][0] * 32 // BITS
        rows = [w[1] for w in words]
        if any(w[0] != words[0][0] for w in words):
            raise UserError(f"{self.where}: {', '.join(hf)}: qweight rows {words} differ")
        if in_dim % g:
            raise UserError(f"{self.where}: {hf[0]}: {in_dim} input rows are not a multiple of group_size {g}")
        groups, out = in_dim // g, sum(rows)
        if out % 2:
            raise UserError(f"{self.where}: {prefix}: {out} output rows; our int4 layout packs rows in pairs")
        for p, n in zip(hf, rows, strict=True):
            if n % 8:
                raise UserError(f"{self.where}: {p}: {n} output columns are not a multiple of 8 (qzeros' words)")
            self._shape(f"{p}.qweight", (in_dim // 8, n), "int32")
            self._shape(f"{p}.qzeros", (groups, n // 8), "int32")
            self._shape(f"{p}.scales", (groups, n), "")
            self._shape(f"{p}.g_idx", (in_dim,), "")
        perm = self._perm(hf, in_dim, g)
        version = self.version

        def weight(r: TensorReader) -> Array:
            codes = np.concatenate([unpack_int32(r.get(f"{p}.qweight"), BITS, 0).T for p in hf])  # [out, in]
            return int4_rows_pack(codes if perm is None else codes[:, perm])

        def zeros(r: TensorReader) -> Array:
            parts = []
            for p in hf:
                words = r.get(f"{p}.qzeros").view(np.uint32)
                if version == 1:
                    words = (words.astype(np.uint64) + V1_ZERO_FIX).astype(np.uint32)  # wraps as int32 does
                parts.append(unpack_int32(words.view(np.int32), BITS, 1).T)  # [out, groups]
            return np.concatenate(parts).astype(np.uint8)

        return [
            Made(
                f"{prefix}.{WEIGHT}",
                (out // 2, in_dim),
                "uint8",
                tuple(f"{p}.{n}" for p in hf for n in ("qweight", "g_idx")),
                weight,
            ),
            Made(
                f"{prefix}.{WEIGHT_SCALE}",
                (out, groups),
                "float32",
                tuple(f"{p}.scales" for p in hf),
                lambda r: np.concatenate([positive_scales(r, f"{p}.scales").T for p in hf]),
            ),
            Made(f"{prefix}.{ZERO_POINT}", (out, groups), "uint8", tuple(f"{p}.qzeros" for p in hf), zeros),
            *(
                [Made(f"{prefix}.{INPUT_PERM}", (in_dim,), "int64", (), lambda r: perm.astype(np.int64))]
                if perm is not None
                else []
            ),
        ]

    def _perm(self, hf: list[str], in_dim: int, g: int) -> Array | None:
        """The input rows sorted by group (stable), None when they already are. The parts of a fused linear read
        one input and must share their g_idx; each group must hold exactly G rows (gptqmodel's act-order does)."""
        with self.ckpt.reader() as r:
            idx = [r.get(f"{p}.g_idx").astype(np.int64) for p in hf]
        for p, i in zip(hf, idx, strict=True):
            if not np.array_equal(i, idx[0]):
                raise UserError(f"{self.where}: {p}.g_idx differs from {hf[0]}.g_idx, yet they are fused")
        if idx[0].min() < 0 or idx[0].max() >= in_dim // g or np.any(np.bincount(idx[0], minlength=in_dim // g) != g):
            raise UserError(f"{self.where}: {hf[0]}.g_idx: every group must hold {g} input rows")
        perm: Array = np.argsort(idx[0], kind="stable")
        return None if np.array_equal(perm, np.arange(in_dim)) else perm
