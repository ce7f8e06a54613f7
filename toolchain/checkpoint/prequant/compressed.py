"""compressed-tensors checkpoints (`quant_method: compressed-tensors`, written by llm-compressor) read into our
methods' layouts without a float detour. Every fact below is from compressed-tensors 0.19.0's own source.

config.json's `quantization_config` (quantization/quant_config.py `QuantizationConfig`): `format`, `config_groups`
{group: {targets, weights, input_activations, output_activations, format}} of `QuantizationArgs`
(quantization/quant_args.py: num_bits, type int|float, symmetric, strategy tensor|channel|group|block|
tensor_group|token, group_size, block_structure, dynamic, actorder), `ignore`, `kv_cache_scheme`,
`quantization_status`, `sparsity_config`, `transform_config`. One scheme per checkpoint is read (our engine runs one
method per checkpoint); several schemes (`mixed-precision`) are refused by name, as are sparsity, transforms
(rotations change the weights), output quantization and experts.

What each scheme becomes (docs/conversion.md, "compressed-tensors and GPTQ"):
- `float-quantized` (compressors/naive_quantized/base.py `FloatQuantizationCompressor`): `weight` float8_e4m3fn
  [out, in], `weight_scale` ([1] tensor, [out, 1] channel, [ceil(out/B0), ceil(in/B1)] block), `input_scale` [1]
  only for static inputs; w = q · s (forward_helpers.py `_dequantize`). Tensor weights + static tensor inputs -> FP8,
  the scales of q/k/v kept one per projection with PREFIX.parts (never requantized to their max: D4); channel
  weights (or tensor ones, broadcast exactly) + dynamic token inputs -> FP8_PER_CHANNEL_PER_TOKEN; tensor weights +
  dynamic tensor inputs -> FP8_DYNAMIC; square block weights + dynamic group inputs -> FP8_BLOCK_SCALES.
- `pack-quantized` (compressors/pack_quantized/base.py, helpers.py `pack_to_int32` / `unpack_from_int32`): the
  signed codes q (−2^(b−1) .. 2^(b−1)−1) plus the offset 2^(b−1) — applied to every value packed, so to an
  asymmetric zero point too — packed densely into int32 along dim 1, the first value in the lowest bits:
  `weight_packed` [out, ceil(in·b/32)], `weight_shape` [2], `weight_scale` [out, in/G] (channel: [out, 1]),
  `weight_zero_point` (asymmetric) packed the same way along dim 0 [ceil(out·b/32), in/G]. w = (q − z) · s, so the
  stored unsigned fields u = q + 2^(b−1) and uz = z + 2^(b−1) give w = (u − uz) · s; symmetric: uz = 2^(b−1). int4
  group -> W4A16_GPTQ (u and uz as its unsigned codes and zero points); int8 symmetric channel -> W8A16 (u − 128).
  `weight_g_idx` (act-order "group", written by compressed-tensors before 0.19 — 0.19 neither writes nor reads
  it, quant_args.py `ActivationOrdering`: "removed 2026/08/27"): input column k belongs to group g_idx[k]; read
  as W4A16_GPTQ's `input_perm` (a stable sort of g_idx, each group then contiguous).
- `nvfp4-pack-quantized` (compressors/nvfp4/base.py `NVFP4PackedCompressor`, nvfp4/helpers.py
  `pack_fp4_to_uint8`): `weight_packed` uint8 [out, in/2] (the even column in the low nibble), `weight_scale`
  float8_e4m3fn [out, in/16], `weight_global_scale` and `input_global_scale` float32 [1] that DIVIDE: w = e2m1 ·
  (s / g) (forward_helpers.py `_dequantize`: `scale = scale / global_scale`). Ours multiply (ModelOpt's and
  TensorRT-LLM's direction, methods/nvfp4.py): stored as 1/g computed in float64 and rounded to float32.
- `kv_cache_scheme` FP8 (8-bit float, per tensor, static): `self_attn.k_scale` and `v_scale` [1] per layer, applied
  to the keys after RoPE and to the values (modeling/kvcache.py `QuantizedKVCache.forward`). Our KV cache has one
  scale per layer: the two where they are equal, else their max as TensorRT-LLM takes it, with a warning (`extras`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np

from toolchain.checkpoint.hf import HFCheckpoint, TensorReader
from toolchain.checkpoint.prequant import Array, Made, hf_prefix, kv_merge_warning, positive_scales
from toolchain.checkpoint.prequant.codecs import int4_rows_pack, unpack_int32
from toolchain.checkpoint.sharding import Rule
from toolchain.checkpoint.trtllm import ModelConfig, QuantConfig
from toolchain.errors import UserError
from toolchain.quantize.methods.base import (
    ACTIVATION_SCALE,
    INPUT_PERM,
    PARTS,
    WEIGHT,
    WEIGHT_SCALE,
    WEIGHT_SCALE_2,
    ZERO_POINT,
)
from toolchain.quantize.methods.kv_cache import KV_SCALE

FORMATS = ("float-quantized", "pack-quantized", "nvfp4-pack-quantized")
NVFP4_BLOCK = 16


def _args(group: dict[str, Any], key: str) -> dict[str, Any] | None:
    value = group.get(key)
    return value if isinstance(value, dict) else None


def _scheme_key(group: dict[str, Any]) -> str:
    """What makes two config groups the same scheme (their targets aside)."""
    keep = ("num_bits", "type", "symmetric", "strategy", "group_size", "block_structure", "dynamic", "actorder")
    parts = {
        k: {a: v for a, v in (_args(group, k) or {}).items() if a in keep} for k in ("weights", "input_activations")
    }
    return json.dumps([parts, group.get("output_activations"), group.get("format")], sort_keys=True)


class CompressedTensors:
    """A compressed-tensors checkpoint: one quantization scheme for every quantized linear."""

    name = "compressed-tensors"

    def __init__(self, ckpt: HFCheckpoint, q: dict[str, Any], source: str) -> None:
        self.warnings: list[str] = []
        self.ckpt, self.q, self.where = ckpt, q, source
        groups = q.get("config_groups") or {}
        if not isinstance(groups, dict) or not groups:
            raise UserError(f"{source}: compressed-tensors quantization_config has no config_groups; re-export it")
        if not all(isinstance(g, dict) for g in groups.values()):
            raise UserError(f"{source}: compressed-tensors config_groups must map names to objects; re-export it")
        if len({_scheme_key(g) for g in groups.values()}) > 1:
            raise UserError(
                f"{source}: compressed-tensors config_groups {', '.join(groups)} hold different schemes (mixed "
                "precision): not yet read (one method per checkpoint); convert a float checkpoint and quantize it"
            )
        self.group: dict[str, Any] = next(iter(groups.values()))
        fmt = self.group.get("format") or q.get("format")
        if fmt not in FORMATS:
            raise UserError(f"{source}: compressed-tensors format {fmt!r} is not read; supported: {', '.join(FORMATS)}")
        self.format: str = fmt
        for key in ("sparsity_config", "transform_config"):
            if q.get(key):
                raise UserError(f"{source}: compressed-tensors {key} is set: not read (it changes the weights)")
        if q.get("quantization_status", "compressed") != "compressed":
            raise UserError(
                f"{source}: compressed-tensors quantization_status {q.get('quantization_status')!r}: only compressed "
                "checkpoints are read (save it with llm-compressor's save_compressed=True)"
            )
        if self.group.get("output_activations"):
            raise UserError(
                f"{source}: compressed-tensors output_activations quantization: not read (no engine mode for it)"
            )
        experts = sorted(n for n in ckpt.tensors if ".experts." in n and n.endswith((".weight_scale", "_packed")))
        if experts:
            raise UserError(f"{source}: experts in compressed-tensors ({experts[0]}, ...): not yet read")
        self.weights: dict[str, Any] = _args(self.group, "weights") or {}
        self.inputs: dict[str, Any] | None = _args(self.group, "input_activations")
        self.algo, self.group_size = self._algo()
        self.kv = self._kv()

    # --- what the scheme becomes ---

    def _refuse(self, what: str) -> UserError:
        return UserError(
            f"{self.where}: compressed-tensors {self.format} with {what}: not read; supported: FP8 (tensor weights "
            "with static or dynamic tensor inputs, channel weights with dynamic token inputs, square block weights), "
            "int4 group (symmetric or not, act-order), int8 symmetric channel, NVFP4 (weights and inputs)"
        )

    def _algo(self) -> tuple[str, int]:
        w, x = self.weights, self.inputs
        bits, kind, strategy = w.get("num_bits"), w.get("type"), w.get("strategy")
        described = f"{bits}-bit {kind} {strategy} weights, " + (
            f"{x.get('num_bits')}-bit {x.get('type')} {x.get('strategy')} {'dynamic' if x.get('dynamic') else 'static'}"
            " inputs"
            if x
            else "no input quantization"
        )
        if self.format == "float-quantized":
            if bits != 8 or kind != "float" or not w.get("symmetric", True) or w.get("dynamic"):
                raise self._refuse(described)
            if x is None or x.get("num_bits") != 8 or x.get("type") != "float" or not x.get("symmetric", True):
                raise self._refuse(described)
            dynamic, xs = bool(x.get("dynamic")), x.get("strategy")
            if strategy == "tensor" and xs == "tensor":
                return ("FP8_DYNAMIC" if dynamic else "FP8"), 128
            if strategy in ("tensor", "channel") and xs == "token" and dynamic:
                return "FP8_PER_CHANNEL_PER_TOKEN", 128
            if strategy == "block" and xs == "group" and dynamic:
                block = w.get("block_structure") or []
                if len(block) != 2 or block[0] != block[1] or x.get("group_size") != block[1]:
                    raise self._refuse(
                        f"{described}, blocks {block}, input groups {x.get('group_size')} (square "
                        "blocks of G x G with input groups of G only)"
                    )
                return "FP8_BLOCK_SCALES", int(block[0])
            raise self._refuse(described)
        if self.format == "pack-quantized":
            if kind != "int" or x is not None or w.get("dynamic"):
                raise self._refuse(described)
            if bits == 4 and strategy == "group" and w.get("group_size"):
                return "W4A16_GPTQ", int(w["group_size"])
            if bits == 8 and strategy == "channel" and w.get("symmetric", True):
                return "W8A16", 128
            raise self._refuse(described)
        # nvfp4-pack-quantized
        if bits != 4 or kind != "float" or strategy != "tensor_group" or w.get("group_size") != NVFP4_BLOCK:
            raise self._refuse(described)
        if x is None:
            raise self._refuse(f"{described} (NVFP4 weights only, W4A16: not yet)")
        if (x.get("num_bits"), x.get("type"), x.get("strategy"), x.get("group_size")) != (
            4,
            "float",
            "tensor_group",
            16,
        ):
            raise self._refuse(described)
        return "NVFP4", NVFP4_BLOCK

    def _kv(self) -> str | None:
        kv = self.q.get("kv_cache_scheme")
        if not kv:
            return None
        if not isinstance(kv, dict):
            raise UserError(f"{self.where}: kv_cache_scheme must be an object, got {kv!r}")
        if (kv.get("num_bits"), kv.get("type"), kv.get("strategy", "tensor"), bool(kv.get("dynamic"))) != (
            8,
            "float",
            "tensor",
            False,
        ):
            raise UserError(
                f"{self.where}: compressed-tensors kv_cache_scheme {json.dumps(kv, sort_keys=True)}: not read; "
                "supported: static per-tensor FP8 (num_bits 8, type float)"
            )
        return "FP8"

    # --- the Format protocol ---

    def quantization(self) -> QuantConfig:
        return QuantConfig(
            quant_algo=self.algo,
            kv_cache_quant_algo=self.kv,
            group_size=self.group_size,
            has_zero_point=self.algo == "W4A16_GPTQ",
        )

    def source(self) -> dict[str, Any]:
        return {
            "format": self.name,
            "quant_method": "compressed-tensors",
            "producer": "compressed-tensors",
            "version": self.q.get("version"),
            "quant_algo": self.algo,
            "settings": {
                "format": self.format,
                "weights": self.weights,
                "input_activations": self.inputs,
                "ignore": self.q.get("ignore"),
                "kv_cache_scheme": self.q.get("kv_cache_scheme"),
            },
        }

    def linear(self, rule: Rule) -> list[Made] | None:
        hf = [hf_prefix(s) for s in rule.srcs]
        marker = "weight_packed" if self.format != "float-quantized" else "weight_scale"
        found = [f"{p}.{marker}" in self.ckpt.tensors for p in hf]
        if not any(found):
            return None
        if not all(found):
            raise UserError(
                f"{self.where}: {', '.join(hf)} are fused into {rule.dst} but only some are quantized "
                f"({', '.join(p for p, f in zip(hf, found, strict=True) if f)}); re-export with all or none in ignore"
            )
        if rule.transpose or rule.offset or rule.halves_swapped or rule.packing:
            raise UserError(f"{self.where}: {rule.dst}: a quantized {rule.srcs[0]} needs a transform we do not apply")
        prefix = rule.dst.removesuffix(".weight")
        if self.format == "float-quantized":
            return self._fp8(prefix, hf)
        if self.format == "pack-quantized":
            return self._packed(prefix, hf)
        return self._nvfp4(prefix, hf)

    def extras(self, cfg: ModelConfig) -> list[Made]:
        """FP8 KV cache: our one scale per layer, exactly the producer's where a layer's k_scale and v_scale are
        equal. Where they differ it is their max, TensorRT-LLM's merge, with a warning: that re-rounds every value
        of the other and is not the producer's model (measured on llm-compressor's FP8 KV checkpoint of the test
        Llama: KLD p95 6e-2 against compressed-tensors' own forward; 0 when its two scales are set to their max)."""
        if self.kv is None:
            return []
        made: list[Made] = []
        pairs: list[tuple[int, float, float]] = []
        with self.ckpt.reader() as r:
            for layer in range(cfg.num_hidden_layers):
                names = tuple(f"model.layers.{layer}.self_attn.{n}_scale" for n in ("k", "v"))
                missing = [n for n in names if n not in self.ckpt.tensors]
                if missing:
                    raise UserError(
                        f"{self.where}: kv_cache_scheme is FP8 but {missing[0]} is missing; re-export the checkpoint"
                    )
                k, v = (float(_f32(r, self._scalar(n))[0]) for n in names)
                pairs.append((layer, k, v))
                merged = np.array([max(k, v)], dtype=np.float32)
                made.append(Made(f"transformer.layers.{layer}.{KV_SCALE}", (1,), "float32", names, _const(merged)))
        warning = kv_merge_warning(self.where, pairs)
        if warning:
            self.warnings.append(warning)
        return made

    # --- per format ---

    def _shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        info = self.ckpt.tensors.get(name)
        if info is None:
            raise UserError(f"{self.where}: {name} is missing ({self.format} needs it); re-export the checkpoint")
        if shape and tuple(info.shape) != shape:
            raise UserError(f"{self.where}: {name} has shape {list(info.shape)}, expected {list(shape)}")
        return tuple(info.shape)

    def _dtype(self, name: str, allowed: tuple[str, ...]) -> None:
        code = self.ckpt.tensors[name].numpy_dtype.name
        if code not in allowed:
            raise UserError(
                f"{self.where}: {name} is {code}; compressed-tensors {self.format} writes {'/'.join(allowed)}"
            )

    def _scalars(self, prefix: str, rows: list[int], scales: dict[str, tuple[list[str], bool]]) -> list[Made]:
        """A fused linear's per-tensor scales, {our suffix: (each part's [1] tensor, inverted)}: one value each
        where every part holds the same (llm-compressor fuses NVFP4's global scales over q/k/v, and q/k/v see one
        input), else one per part with PREFIX.parts (D4: never requantized to the largest). 1/g in float64."""
        with self.ckpt.reader() as r:
            values = {k: [float(_f32(r, self._scalar(s))[0]) for s in srcs] for k, (srcs, _) in scales.items()}
        split = len(rows) > 1 and any(len(set(v)) > 1 for v in values.values())
        made = (
            [Made(f"{prefix}.{PARTS}", (len(rows),), "int64", (), _const(np.array(rows, dtype=np.int64)))]
            if split
            else []
        )
        for suffix, (srcs, invert) in scales.items():
            v = np.array(values[suffix] if split else values[suffix][:1], dtype=np.float64)
            made.append(
                Made(
                    f"{prefix}.{suffix}",
                    v.shape,
                    "float32",
                    tuple(srcs),
                    _const((1.0 / v if invert else v).astype(np.float32)),
                )
            )
        return made

    def _scalar(self, name: str) -> str:
        self._shape(name, (1,))
        self._dtype(name, ("float32", "bfloat16", "float16"))
        return name

    def _fp8(self, prefix: str, hf: list[str]) -> list[Made]:
        shapes = [self._shape(f"{p}.weight", ()) for p in hf]
        for p in hf:
            self._dtype(f"{p}.weight", ("float8_e4m3fn",))
        rows, in_dim = [s[0] for s in shapes], shapes[0][1]
        if any(len(s) != 2 or s[1] != in_dim for s in shapes):
            raise UserError(f"{self.where}: {', '.join(hf)}: weights {shapes} do not share their input width")
        out = sum(rows)
        weight = Made(
            f"{prefix}.{WEIGHT}",
            (out, in_dim),
            "float8_e4m3fn",
            tuple(f"{p}.weight" for p in hf),
            lambda r: np.concatenate([r.get(f"{p}.weight") for p in hf]),
        )
        scales = [f"{p}.weight_scale" for p in hf]
        if self.algo in ("FP8", "FP8_DYNAMIC"):
            scalars = {WEIGHT_SCALE: (scales, False)}
            if self.algo == "FP8":
                scalars[ACTIVATION_SCALE] = ([f"{p}.input_scale" for p in hf], False)
            return [weight, *self._scalars(prefix, rows, scalars)]
        if self.algo == "FP8_PER_CHANNEL_PER_TOKEN":
            per_tensor = self.weights.get("strategy") == "tensor"
            for s, n in zip(scales, rows, strict=True):
                self._shape(s, (1,) if per_tensor else (n, 1))

            def channel(r: TensorReader) -> Array:
                got = [np.broadcast_to(_f32(r, s).reshape(-1), (n,)) for s, n in zip(scales, rows, strict=True)]
                return np.concatenate(got).astype(np.float32)

            return [weight, Made(f"{prefix}.{WEIGHT_SCALE}", (out,), "float32", tuple(scales), channel)]
        # FP8_BLOCK_SCALES
        g = self.group_size
        if len(rows) > 1 and any(n % g for n in rows[:-1]):
            raise UserError(
                f"{self.where}: {', '.join(hf)} fuse into {prefix} but their rows {rows} are not multiples of the "
                f"{g}-row blocks (the fused scale rows would straddle two projections)"
            )
        cols = -(-in_dim // g)
        for s, n in zip(scales, rows, strict=True):
            self._shape(s, (-(-n // g), cols))
        return [
            weight,
            Made(
                f"{prefix}.{WEIGHT_SCALE}",
                (-(-out // g), cols),
                "float32",
                tuple(scales),
                lambda r: np.concatenate([_f32(r, s) for s in scales]),
            ),
        ]

    def _packed(self, prefix: str, hf: list[str]) -> list[Made]:
        bits = int(self.weights["num_bits"])
        shapes: list[tuple[int, int]] = []
        for p in hf:
            self._shape(f"{p}.weight_shape", (2,))
            self._dtype(f"{p}.weight_packed", ("int32",))
            packed = self._shape(f"{p}.weight_packed", ())
            if len(packed) != 2:
                raise UserError(
                    f"{self.where}: {p}.weight_packed has shape {list(packed)}; it must be 2-D [out, words]"
                )
            shapes.append((packed[0], packed[1] * 32 // bits))  # in: exact once weight_shape is read
        # weight_shape's values are data: read them now (a few bytes) so the plan knows the shapes
        with self.ckpt.reader() as r:
            declared = [tuple(int(v) for v in r.get(f"{p}.weight_shape")) for p in hf]
        for p, (n_rows, width), got in zip(hf, shapes, declared, strict=True):
            if got[0] != n_rows or not (width - 32 // bits < got[1] <= width):
                raise UserError(f"{self.where}: {p}.weight_shape {list(got)} does not fit weight_packed")
        rows = [d[0] for d in declared]
        in_dim = declared[0][1]
        if any(d[1] != in_dim for d in declared):
            raise UserError(f"{self.where}: {', '.join(hf)}: input widths {declared} differ")
        out = sum(rows)
        srcs = tuple(f"{p}.{n}" for p in hf for n in ("weight_packed", "weight_shape"))

        def codes(r: TensorReader) -> Array:
            """The unsigned stored fields u = q + 2^(b-1) [out, in] (int32)."""
            return np.concatenate([unpack_int32(r.get(f"{p}.weight_packed"), bits, 1)[:, :in_dim] for p in hf])

        if self.algo == "W8A16":
            scales = [f"{p}.weight_scale" for p in hf]
            for s, n in zip(scales, rows, strict=True):
                self._shape(s, (n, 1))
            return [
                Made(f"{prefix}.{WEIGHT}", (out, in_dim), "int8", srcs, lambda r: (codes(r) - 128).astype(np.int8)),
                Made(
                    f"{prefix}.{WEIGHT_SCALE}",
                    (out,),
                    "float32",
                    tuple(scales),
                    lambda r: np.concatenate([_f32(r, s).reshape(-1) for s in scales]),
                ),
            ]
        g = self.group_size
        if in_dim % g:
            raise UserError(f"{self.where}: {hf[0]}: {in_dim} input channels are not a multiple of group_size {g}")
        if out % 2:
            raise UserError(f"{self.where}: {prefix}: {out} output rows; our int4 layout packs rows in pairs")
        groups = in_dim // g
        scales = [f"{p}.weight_scale" for p in hf]
        for s, n in zip(scales, rows, strict=True):
            self._shape(s, (n, groups))
        symmetric = self.weights.get("symmetric", True)
        zeros = [f"{p}.weight_zero_point" for p in hf]
        if not symmetric:
            for z, n in zip(zeros, rows, strict=True):
                self._shape(z, (-(-n * bits // 32), groups))
        g_idx = [f"{p}.weight_g_idx" for p in hf]
        has_g_idx = [n in self.ckpt.tensors for n in g_idx]
        if any(has_g_idx) and not all(has_g_idx):
            raise UserError(f"{self.where}: only some of {', '.join(g_idx)} exist; re-export the checkpoint")
        perm = self._perm(g_idx, in_dim, g) if all(has_g_idx) else None

        def zero_points(r: TensorReader) -> Array:
            if symmetric:
                return np.full((out, groups), 1 << (bits - 1), dtype=np.uint8)
            return np.concatenate(
                [unpack_int32(r.get(z), bits, 0)[:n] for z, n in zip(zeros, rows, strict=True)]
            ).astype(np.uint8)

        def weight(r: TensorReader) -> Array:
            c = codes(r)
            return int4_rows_pack(c if perm is None else c[:, perm])

        made = [
            Made(
                f"{prefix}.{WEIGHT}",
                (out // 2, in_dim),
                "uint8",
                srcs + (tuple(g_idx) if perm is not None else ()),
                weight,
            ),
            Made(
                f"{prefix}.{WEIGHT_SCALE}",
                (out, groups),
                "float32",
                tuple(scales),
                lambda r: np.concatenate([_f32(r, s) for s in scales]),
            ),
            Made(f"{prefix}.{ZERO_POINT}", (out, groups), "uint8", () if symmetric else tuple(zeros), zero_points),
        ]
        if perm is not None:
            made.append(Made(f"{prefix}.{INPUT_PERM}", (in_dim,), "int64", (), lambda r: perm.astype(np.int64)))
        return made

    def _perm(self, names: list[str], in_dim: int, g: int) -> Array | None:
        """Act-order: the input columns sorted by group (stable), None when they already are. Every part of a
        fused linear reads the same input, so all must agree; each group must hold exactly G columns."""
        with self.ckpt.reader() as r:
            idx = [r.get(n).astype(np.int64).reshape(-1) for n in names]
        for n, i in zip(names, idx, strict=True):
            if i.shape != (in_dim,) or not np.array_equal(i, idx[0]):
                raise UserError(f"{self.where}: {n} differs from {names[0]} or is not [{in_dim}]")
        counts = np.bincount(np.clip(idx[0], 0, None), minlength=in_dim // g)  # a negative index: refused below
        if idx[0].min() < 0 or len(counts) != in_dim // g or np.any(counts != g):
            raise UserError(f"{self.where}: {names[0]}: groups must hold {g} columns each (act-order by group)")
        perm: Array = np.argsort(idx[0], kind="stable")
        return None if np.array_equal(perm, np.arange(in_dim)) else perm

    def _nvfp4(self, prefix: str, hf: list[str]) -> list[Made]:
        shapes = [self._shape(f"{p}.weight_packed", ()) for p in hf]
        for p in hf:
            self._dtype(f"{p}.weight_packed", ("uint8",))
            self._dtype(f"{p}.weight_scale", ("float8_e4m3fn",))
        rows, half = [s[0] for s in shapes], shapes[0][1]
        in_dim, out = half * 2, sum(rows)
        if any(s[1] != half for s in shapes):
            raise UserError(f"{self.where}: {', '.join(hf)}: packed widths {shapes} differ")
        for p, n in zip(hf, rows, strict=True):
            self._shape(f"{p}.weight_scale", (n, in_dim // NVFP4_BLOCK))
        return [
            Made(
                f"{prefix}.{WEIGHT}",
                (out, half),
                "uint8",
                tuple(f"{p}.weight_packed" for p in hf),
                lambda r: np.concatenate([r.get(f"{p}.weight_packed") for p in hf]),
            ),
            Made(
                f"{prefix}.{WEIGHT_SCALE}",
                (out, in_dim // NVFP4_BLOCK),
                "float8_e4m3fn",
                tuple(f"{p}.weight_scale" for p in hf),
                lambda r: np.concatenate([r.get(f"{p}.weight_scale") for p in hf]),
            ),
            *self._scalars(
                prefix,
                rows,
                {
                    WEIGHT_SCALE_2: ([f"{p}.weight_global_scale" for p in hf], True),
                    ACTIVATION_SCALE: ([f"{p}.input_global_scale" for p in hf], True),
                },
            ),
        ]


def _const(value: Array) -> Callable[[TensorReader], Array]:
    return lambda r: value


def _f32(r: TensorReader, name: str) -> Array:
    """A scale as float32 (bfloat16 / float16 / float32 convert exactly), refused unless finite and positive."""
    return positive_scales(r, name)
