"""NVIDIA ModelOpt's unified Hugging Face export (`modelopt.torch.export.export_hf_checkpoint`), read into our
methods' layouts: FP8 (+ FP8 KV cache) -> fp8, INT4 AWQ -> w4a16_awq, W4A8 AWQ -> w4a8_awq, NVFP4 -> nvfp4.

Every fact below is ModelOpt 0.47's own code (modelopt/torch/export/, read in trtbuild's .venv):

- Detection: `hf_quant_config.json` {"producer": {name, version}, "quantization": {quant_algo, kv_cache_quant_algo,
  group_size, has_zero_point, pre_quant_scale, exclude_modules}} beside config.json (unified_export_hf.py
  `_export_transformers_checkpoint` / `export_hf_checkpoint`), and config.json's `quantization_config` with
  `quant_method: "modelopt"`, `quant_algo`, `config_groups`, `ignore`, `kv_cache_scheme`, `producer`
  (convert_hf_config.py `convert_hf_quant_config_format`). The first is read where present (prequant.detect).
- Tensors per quantized linear PREFIX (unified_export_hf.py `_export_quantized_weight`; names from
  quant_utils.py `quantizer_attr_names`): PREFIX.weight, PREFIX.weight_scale, PREFIX.weight_scale_2 (NVFP4,
  W4A8_AWQ: `get_weight_scaling_factor_2`), PREFIX.input_scale (`get_activation_scaling_factor`, amax / maxbound:
  a multiplying scale), PREFIX.pre_quant_scale (AWQ; quant_utils.py `_KV_CACHE_REPLACEMENTS` renames
  `input_quantizer._pre_quant_scale`). Per-tensor scales are 0-d tensors; we store them [1].
- FP8: weight float8_e4m3fn = w / weight_scale, weight_scale = amax / 448 (`_export_quantized_weight`, FP8 branch);
  so w = weight · weight_scale, our fp8 layout unchanged.
- INT4 AWQ / W4A8 AWQ: weight uint8 [out/2, in], codes round(w / weight_scale) clamped to [-8, 7], output rows 2j
  in the low nibble and 2j+1 in the high one (quant_utils.py `pack_int4_in_uint8`, `to_quantized_weight`) — our
  w4a16 packing, so the bytes are reinterpreted as int8, not repacked; weight_scale float32 [out, in/G] the full
  int4 step (`get_weight_scaling_factor` -> `get_scaling_factor(weight_quantizer[0])` for W4A8's
  SequentialQuantizer); W4A8's weight_scale_2 is the FP8 stage's scale (`get_weight_scaling_factor_2` ->
  `get_scaling_factor(weight_quantizer[-1])`), stored as given for w4a8_awq to read.
- NVFP4: weight uint8 [out, in/2] (two E2M1 a byte, even column low), weight_scale float8_e4m3fn [out, in/16],
  weight_scale_2 float32 (multiplies: "Dequant is ``nibble * weight_scale * weight_scale_2``",
  `_export_quantized_weight`), input_scale the input's global scale — our nvfp4 layout, names aside.
- KV cache: `k_proj.k_scale` / `v_proj.v_scale` = amax / maxbound (quant_utils.py `postprocess_state_dict`,
  `_KV_CACHE_REPLACEMENTS`); TensorRT-LLM keeps one scale per layer, max(k, v) (checkpoint/trtllm.py
  `kv_cache_scale`), and so do we.
- KV scales use maxbound 448 (`kv_cache_max_bound` in unified_export_hf.py `_export_transformers_checkpoint`),
  not clamped to >= 1 as the TensorRT-LLM export's `get_kv_cache_scaling_factor` clamps them.
- 0.47 resmooths AWQ's q/k/v and gate/up to one pre_quant_scale and folds it into the preceding norm
  (unified_export_hf.py `requantize_resmooth_fused_llm_layers`), so those carry none; a linear that still has one
  (o_proj) keeps it as its prequant_scaling_factor.

Fused q/k/v (our attention.qkv) keep per-projection scales (decision D4): where the parts' per-tensor scales
differ (0.47's FP8 export does not unify q/k/v weight scales), PREFIX.parts and one scale per part are written,
never a requantization to the largest. Linears without weight_scale (exclude_modules) stay float. Mixed precision
(`quantized_layers`) and quantized experts are refused by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from toolchain.checkpoint.hf import HFCheckpoint, TensorReader
from toolchain.checkpoint.prequant import Array, Made, file_of, hf_prefix, kv_merge_warning
from toolchain.checkpoint.safetensors_io import TORCH_NAMES
from toolchain.checkpoint.sharding import Rule
from toolchain.checkpoint.trtllm import ModelConfig, QuantConfig
from toolchain.errors import UserError

# ModelOpt quant_algo -> (our method's needs): weight dtype as stored, whether weight_scale_2 / input_scale exist
ALGOS: dict[str, dict[str, Any]] = {
    "FP8": {"weight": "F8_E4M3", "scale_2": False, "input": True, "int4": False},
    "W4A16_AWQ": {"weight": "U8", "scale_2": False, "input": False, "int4": True},
    "W4A8_AWQ": {"weight": "U8", "scale_2": True, "input": True, "int4": True},
    "NVFP4": {"weight": "U8", "scale_2": True, "input": True, "int4": False},
    # int8_wo: int8 [out, in] and one scale per output row (quant_utils.py get_weight_scaling_factor: per-channel)
    "W8A16": {"weight": "I8", "scale_2": False, "input": False, "int4": False},
}
KV_ALGOS = ("FP8",)
FLOAT_WEIGHTS = ("F64", "F32", "F16", "BF16")
NVFP4_BLOCK = 16
Make = Callable[[TensorReader], Array]


def _scalar(name: str) -> Make:
    """A reader of one per-tensor scale (0-d or [1]) as float32, refused unless finite and positive."""

    def read(reader: TensorReader) -> Array:
        v = np.asarray(reader.get(name), dtype=np.float32).reshape(-1)
        if v.size != 1 or not np.isfinite(v).all() or v[0] <= 0:
            raise UserError(
                f"{reader.file_of(name)}: tensor {name} = {v.tolist()}; a per-tensor scale must be one finite "
                "positive value. Re-export the checkpoint"
            )
        return v

    return read


class ModelOptHF:
    """A ModelOpt unified HF checkpoint (prequant.Format)."""

    name = "modelopt"

    def __init__(self, ckpt: HFCheckpoint, q: dict[str, Any], source: str) -> None:
        self.warnings: list[str] = []
        self.ckpt, self.file = ckpt, source
        if isinstance(q.get("quantization"), dict):  # hf_quant_config.json
            body: dict[str, Any] = q["quantization"]
            self.algo, self.kv_algo = body.get("quant_algo"), body.get("kv_cache_quant_algo")
            self.group_size = body.get("group_size")
            self.exclude: list[str] = list(body.get("exclude_modules") or [])
            mixed = body.get("quantized_layers")
        else:  # config.json's quantization_config (convert_hf_quant_config_format)
            body = q
            self.algo = q.get("quant_algo")
            kv = q.get("kv_cache_scheme")
            self.kv_algo = _kv_from_scheme(kv, source)
            weights = ((q.get("config_groups") or {}).get("group_0") or {}).get("weights") or {}
            self.group_size = weights.get("group_size")
            self.exclude = list(q.get("ignore") or [])
            mixed = q.get("quantized_layers")
        self.settings = body
        self.producer = q.get("producer") or {}
        if self.algo == "MIXED_PRECISION" or mixed:
            groups = sorted({str(v.get("quant_algo")) for v in (mixed or {}).values() if isinstance(v, dict)})
            raise UserError(
                f"{source}: a mixed-precision ModelOpt checkpoint (quant_algo {self.algo}, per-layer algos "
                f"{', '.join(groups) or 'not listed'}); trtbuild reads one quant_algo per checkpoint. Export it "
                f"with one of {', '.join(ALGOS)}"
            )
        if self.algo not in ALGOS:
            raise UserError(
                f"{source}: ModelOpt quant_algo {self.algo!r} is not one trtbuild reads; supported: "
                f"{', '.join(ALGOS)}. Re-export with one of them, or convert the float model and quantize it"
            )
        if self.kv_algo is not None and self.kv_algo not in KV_ALGOS:
            raise UserError(
                f"{source}: ModelOpt kv_cache_quant_algo {self.kv_algo!r} is not one trtbuild reads; supported: "
                f"{', '.join(KV_ALGOS)} or none"
            )
        self.spec = ALGOS[self.algo]
        if self.spec["int4"] and self.group_size is None:
            # 0.47's config.json form of W4A16_AWQ has no config_groups (convert_hf_quant_config_format), so no
            # group size: the tensors say it (weight [out/2, in], weight_scale [out, in/G]); _shape checks the rest
            self.group_size = _group_from_tensors(ckpt)
        if self.spec["int4"] and (not isinstance(self.group_size, int) or self.group_size <= 0):
            raise UserError(f"{source}: {self.algo} needs a positive integer group_size, got {self.group_size!r}")
        experts = sorted(n for n in ckpt.tensors if ".experts." in n and n.endswith(".weight_scale"))
        if experts:
            raise UserError(
                f"{ckpt.root}: quantized experts in a ModelOpt {self.algo} checkpoint ({experts[0]}, ...): not yet; "
                "convert the float model and quantize it with trtbuild"
            )
        self.qkv: list[tuple[str, tuple[str, ...]]] = []  # (our layer prefix, HF q/k/v prefixes) seen by linear

    # -- Format --------------------------------------------------------------------------------------------------

    def quantization(self) -> QuantConfig:
        awq = self.algo in ("W4A16_AWQ", "W4A8_AWQ")
        group = int(self.group_size or 0) if self.spec["int4"] else (NVFP4_BLOCK if self.algo == "NVFP4" else 128)
        return QuantConfig(
            quant_algo=self.algo, kv_cache_quant_algo=self.kv_algo, group_size=group, pre_quant_scale=awq
        )

    def source(self) -> dict[str, Any]:
        return {
            "format": self.name,
            "quant_method": "modelopt",
            "producer": self.producer.get("name", "modelopt"),
            "version": self.producer.get("version"),
            "quant_algo": self.algo,
            "kv_cache_quant_algo": self.kv_algo,
            "file": self.file,
            "settings": self.settings,
        }

    def linear(self, rule: Rule) -> list[Made] | None:
        prefixes = [hf_prefix(s) for s in rule.srcs]
        out = rule.dst.removesuffix(".weight")
        if out.endswith(".attention.qkv") and len(prefixes) == 3:
            self.qkv.append((out.removesuffix(".qkv"), tuple(prefixes)))
        quantized = [f"{p}.weight_scale" in self.ckpt.tensors for p in prefixes]
        if not any(quantized):
            self._check_float(rule)
            return None
        if not all(quantized) or rule.transpose or rule.offset or rule.halves_swapped:
            raise UserError(
                f"{self.ckpt.root}: {rule.dst} fuses {', '.join(rule.srcs)}, of which only some are quantized "
                f"(weight_scale present: {quantized}); the parts of one GEMM are quantized together. Re-export "
                "with the same exclusion for all of them"
            )
        return self._quantized(out, prefixes)

    def extras(self, cfg: ModelConfig) -> list[Made]:
        if self.kv_algo is None:
            return []
        made = []
        pairs: list[tuple[int, float, float]] = []
        with TensorReader(self.ckpt) as reader:  # read now: a warning names layers whose two scales differ
            for i, (layer, (_, k, v)) in enumerate(self.qkv):
                names = (f"{k}.k_scale", f"{v}.v_scale")
                for n in names:
                    if n not in self.ckpt.tensors:
                        raise UserError(
                            f"{self.ckpt.root}: {n} missing; kv_cache_quant_algo {self.kv_algo} needs k_scale and "
                            "v_scale for every layer. Re-export the checkpoint"
                        )
                k_scale, v_scale = (float(_scalar(n)(reader)[0]) for n in names)
                pairs.append((i, k_scale, v_scale))
                made.append(Made(f"{layer}.kv_cache_scaling_factor", (1,), "float32", names, _kv_max(names)))
        warning = kv_merge_warning(self.file, pairs)
        if warning:
            self.warnings.append(warning)
        return made

    # -- the layouts ---------------------------------------------------------------------------------------------

    def _check_float(self, rule: Rule) -> None:
        """A linear stored unquantized must be a float tensor: codes without their scale would convert to garbage."""
        for src in rule.srcs:
            info = self.ckpt.tensors.get(src)
            if info is not None and info.code not in FLOAT_WEIGHTS:
                raise UserError(
                    f"{file_of(self.ckpt, src)}: {src} is {TORCH_NAMES[info.code]} but {hf_prefix(src)}.weight_scale "
                    "is missing; a quantized weight needs its scale. Re-export the checkpoint"
                )

    def _need(self, name: str) -> str:
        if name not in self.ckpt.tensors:
            raise UserError(
                f"{self.ckpt.root}: {name} missing; ModelOpt {self.algo} stores it for every quantized linear. "
                "Re-export the checkpoint"
            )
        return name

    def _shape(self, name: str, want: tuple[int, ...], dtype: str | None = None) -> None:
        info = self.ckpt.tensors[name]
        got = info.shape if info.shape else (1,)
        if tuple(got) != want or (dtype is not None and info.code != dtype):
            raise UserError(
                f"{file_of(self.ckpt, name)}: tensor {name} is {TORCH_NAMES[info.code]}{list(info.shape)}, "
                f"ModelOpt {self.algo} stores {TORCH_NAMES[dtype] if dtype else ''}{list(want)} there; the "
                "checkpoint does not match its own hf_quant_config.json"
            )

    def _quantized(self, out: str, prefixes: list[str]) -> list[Made]:
        algo, spec = self.algo, self.spec
        weights = [self._need(f"{p}.weight") for p in prefixes]
        scales = [self._need(f"{p}.weight_scale") for p in prefixes]
        for w in weights:
            if self.ckpt.tensors[w].code != spec["weight"]:
                info = self.ckpt.tensors[w]
                raise UserError(
                    f"{file_of(self.ckpt, w)}: tensor {w} is {TORCH_NAMES[info.code]}, ModelOpt {algo} stores "
                    f"{TORCH_NAMES[spec['weight']]} weights"
                )
        shapes = [self.ckpt.tensors[w].shape for w in weights]
        in_packed = shapes[0][1] if len(shapes[0]) == 2 else -1
        if any(len(s) != 2 or s[1] != in_packed for s in shapes):
            raise UserError(f"{self.ckpt.root}: {', '.join(weights)} disagree in input width: {shapes}")
        made: list[Made] = []
        if algo == "FP8":
            rows = [s[0] for s in shapes]
            for n in scales:
                self._shape(n, (1,))
            made.append(Made(f"{out}.weight", (sum(rows), in_packed), "float8_e4m3fn", tuple(weights), _rows(weights)))
        elif algo == "W8A16":
            rows = [s[0] for s in shapes]
            for n, r in zip(scales, rows, strict=True):
                self._shape(n, (r,))
            made.append(Made(f"{out}.weight", (sum(rows), in_packed), "int8", tuple(weights), _rows(weights)))
            made.append(Made(f"{out}.weights_scaling_factor", (sum(rows),), "float32", tuple(scales),
                             _rows(scales, finite=True, cast=np.float32)))  # fmt: skip
        elif algo == "NVFP4":
            rows = [s[0] for s in shapes]
            blocks = in_packed * 2 // NVFP4_BLOCK
            for n, r in zip(scales, rows, strict=True):
                self._shape(n, (r, blocks), "F8_E4M3")
            made.append(Made(f"{out}.weight", (sum(rows), in_packed), "uint8", tuple(weights), _rows(weights)))
            made.append(Made(f"{out}.weights_scaling_factor", (sum(rows), blocks), "float8_e4m3fn", tuple(scales),
                             _rows(scales, finite=True)))  # fmt: skip
        else:  # int4: two output rows a byte
            rows = [s[0] * 2 for s in shapes]
            g = int(self.group_size or 0)
            if in_packed % g:
                raise UserError(
                    f"{self.ckpt.root}: {weights[0]} has {in_packed} input channels, not whole groups of {g} "
                    f"(group_size in {self.file})"
                )
            for n, r in zip(scales, rows, strict=True):
                self._shape(n, (r, in_packed // g))
            made.append(Made(f"{out}.weight", (sum(rows) // 2, in_packed), "int8", tuple(weights),
                             _rows(weights, view=np.int8)))  # fmt: skip
            made.append(Made(f"{out}.weights_scaling_factor", (sum(rows), in_packed // g), "float32", tuple(scales),
                             _rows(scales, finite=True, cast=np.float32)))  # fmt: skip
            made.extend(self._prequant(out, prefixes, in_packed))
        per_tensor = []
        if algo == "FP8":
            per_tensor.append(("weights_scaling_factor", scales))
        if spec["scale_2"]:
            per_tensor.append(("weights_scaling_factor_2", [self._need(f"{p}.weight_scale_2") for p in prefixes]))
        if spec["input"]:
            per_tensor.append(("activation_scaling_factor", [self._need(f"{p}.input_scale") for p in prefixes]))
        made.extend(self._per_tensor(out, rows, per_tensor))
        return made

    def _prequant(self, out: str, prefixes: list[str], in_dim: int) -> list[Made]:
        names = [f"{p}.pre_quant_scale" for p in prefixes]
        have = [n in self.ckpt.tensors for n in names]
        if not any(have):
            return []
        if not all(have):
            raise UserError(
                f"{self.ckpt.root}: {out} fuses linears of which only some have pre_quant_scale "
                f"({[n for n, h in zip(names, have, strict=True) if h]}); one input cannot be scaled two ways"
            )
        for n in names:
            self._shape(n, (in_dim,))
        dtype = TORCH_NAMES[self.ckpt.tensors[names[0]].code]

        def make(reader: TensorReader) -> Array:
            values = [_finite(reader, n, reader.get(n)) for n in names]
            for n, v in zip(names[1:], values[1:], strict=True):
                if not np.array_equal(v, values[0]):
                    raise UserError(
                        f"{reader.file_of(n)}: {n} differs from {names[0]}; the fused GEMM {out} reads one input, "
                        "so its parts must share one pre_quant_scale. Re-export with them fused"
                    )
            return np.ascontiguousarray(values[0])

        return [Made(f"{out}.prequant_scaling_factor", (in_dim,), dtype, tuple(names), make)]

    def _per_tensor(self, out: str, rows: list[int], groups: list[tuple[str, list[str]]]) -> list[Made]:
        """Per-tensor scales of a linear: [1] each, or where a fused linear's parts differ in any of them, one value
        per part of every one and PREFIX.parts (D4)."""
        if len(rows) == 1:
            return [Made(f"{out}.{sfx}", (1,), "float32", (names[0],), _scalar(names[0])) for sfx, names in groups]
        all_names = tuple(n for _, names in groups for n in names)

        def values(reader: TensorReader) -> dict[str, Array]:
            return {n: _scalar(n)(reader) for n in all_names}

        def differ(reader: TensorReader) -> bool:
            v = values(reader)
            return any(len({float(v[n][0]) for n in names}) > 1 for _, names in groups)

        with TensorReader(self.ckpt) as reader:  # the plan needs the shapes now: read the (scalar) scales
            split = differ(reader)
        if not split:  # the parts agree: one scale (every part's tensor is read, and checked, by the plan above)
            return [Made(f"{out}.{sfx}", (1,), "float32", tuple(names), _scalar(names[0])) for sfx, names in groups]
        made = [
            Made(f"{out}.{suffix}", (len(rows),), "float32", tuple(names), _stack_scalars(names))
            for suffix, names in groups
        ]
        parts = np.asarray(rows, dtype=np.int64)
        made.append(Made(f"{out}.parts", (len(rows),), "int64", (), lambda _r: parts.copy()))
        return made


def _group_from_tensors(ckpt: HFCheckpoint) -> int | None:
    for name, info in sorted(ckpt.tensors.items()):
        w = ckpt.tensors.get(name.removesuffix("_scale")) if name.endswith(".weight_scale") else None
        if w is not None and len(w.shape) == 2 and len(info.shape) == 2 and info.shape[1]:
            return int(w.shape[1] // info.shape[1]) if w.shape[1] % info.shape[1] == 0 else None
    return None


def _kv_from_scheme(kv: Any, source: str) -> str | None:
    if kv is None:
        return None
    if isinstance(kv, str):
        return kv
    if isinstance(kv, dict) and kv.get("type") == "float" and kv.get("num_bits") == 8:
        return "FP8"
    raise UserError(f"{source}: kv_cache_scheme {kv!r} is not one trtbuild reads; supported: 8-bit float (FP8)")


def _finite(reader: TensorReader, name: str, a: Array) -> Array:
    if not np.isfinite(np.asarray(a, dtype=np.float32)).all():
        raise UserError(f"{reader.file_of(name)}: tensor {name} has NaN/Inf values; re-export the checkpoint")
    return a


def _rows(names: list[str], finite: bool = False, view: Any = None, cast: Any = None) -> Make:
    """A reader of tensors concatenated along the rows (the fused GEMM's parts in order)."""

    def make(reader: TensorReader) -> Array:
        parts, first = [], None
        for n in names:
            a = reader.get(n)
            if finite:
                _finite(reader, n, a)
            if cast is not None:
                a = a.astype(cast)
            first = a.dtype if first is None else first
            parts.append(a.view(np.uint8) if a.dtype.itemsize == 1 else a)
        joined = np.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]
        result: Array = joined.view(view if view is not None else first)
        return np.ascontiguousarray(result)

    return make


def _stack_scalars(names: tuple[str, ...] | list[str]) -> Make:
    def make(reader: TensorReader) -> Array:
        return np.concatenate([_scalar(n)(reader) for n in names])

    return make


def _kv_max(names: tuple[str, str]) -> Make:
    """max(k_scale, v_scale): TensorRT-LLM's one KV cache scale per layer (trtllm.kv_cache_scale)."""

    def make(reader: TensorReader) -> Array:
        k, v = (_scalar(n)(reader) for n in names)
        merged: Array = np.maximum(k, v).astype(np.float32)
        return merged

    return make
