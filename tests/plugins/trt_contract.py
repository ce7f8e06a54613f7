"""A stand-in for `tensorrt` and `tensorrt.plugin` that follows the documented ahead-of-time plugin contract, for
testing toolchain/plugins/tensorrt_registration.py where TensorRT cannot be installed; and, run as a script, the
registration's aot_impl on real PTX (a subprocess: compiling needs TRITON_INTERPRET unset, which pytest sets).

What it mirrors (TensorRT's python/packaging/bindings_wheel/tensorrt/plugin, 10.x): `register` / `autotune` /
`aot_impl` check the functions' signatures and annotations as its _validate.py does (as classes: a string
annotation fails) and record them; `TensorDesc` has `shape_expr`, `dtype`, `like()`, `aliased()`; shape expressions
support + - * //; `KernelLaunchParams` wraps every field in `SymInt32`; TensorRT refuses an extra argument that is
not a `SymInt32` ("Extra args must be a 'tensorrt.plugin.SymInt32'"); `AutoTuneCombination` type names are "FP32",
"FP16" or a `trt.DataType` member name. Here a symbolic dim is a `Sym` whose text names its origin ("q.0")."""

from __future__ import annotations

import contextlib
import enum
import importlib
import inspect
import json
import sys
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


class DataType(enum.Enum):
    FLOAT = 0
    HALF = 1
    INT8 = 2
    INT32 = 3
    BOOL = 4
    UINT8 = 5
    FP8 = 6
    BF16 = 7
    INT64 = 8


def str_to_data_type(name: str) -> DataType:
    """tensorrt.plugin's _str_to_data_type: FP32, FP16, else a DataType member's name."""
    if name == "FP32":
        return DataType.FLOAT
    if name == "FP16":
        return DataType.HALF
    return DataType[name]


class Sym:
    """A symbolic int: its text, and its value given the values of the named dims."""

    def __init__(self, text: str, fn: Callable[[dict[str, int]], int] | None = None):
        self.text = text
        self.fn = fn or (lambda env: env[text])

    def _op(self, other: Any, sign: str, f: Callable[[int, int], int]) -> Sym:
        o = other if isinstance(other, Sym) else Sym(str(other), lambda env, v=int(other): v)
        return Sym(f"({self.text}{sign}{o.text})", lambda env: f(self.fn(env), o.fn(env)))

    def __add__(self, o: Any) -> Sym:
        return self._op(o, "+", lambda x, y: x + y)

    def __sub__(self, o: Any) -> Sym:
        return self._op(o, "-", lambda x, y: x - y)

    def __mul__(self, o: Any) -> Sym:
        return self._op(o, "*", lambda x, y: x * y)

    def __floordiv__(self, o: Any) -> Sym:
        return self._op(o, "//", lambda x, y: x // y)

    __radd__ = __add__
    __rmul__ = __mul__

    def __repr__(self) -> str:
        return f"Sym({self.text})"


class SymInt32:
    def __init__(self, value: Any = None):
        if isinstance(value, SymInt32):
            value = value.value
        if not isinstance(value, (int, Sym)) or isinstance(value, bool):
            raise TypeError(f"SymInt32 of {type(value).__name__}: takes an int or a symbolic expression")
        self.value = value


class SymIntExprs:
    def __init__(self, length: int):
        self._exprs: list[Any] = [None] * length

    def __setitem__(self, i: int, v: Any) -> None:
        if i >= len(self._exprs):
            raise IndexError("Index out of range")
        self._exprs[i] = v

    def __len__(self) -> int:
        return len(self._exprs)

    def __iter__(self) -> Any:
        return iter(self._exprs)


class KernelLaunchParams:
    FIELDS = ("grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z", "shared_mem")

    def __init__(self) -> None:
        for f in self.FIELDS:
            self.__dict__[f] = SymInt32(0 if f == "shared_mem" else 1)

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self.FIELDS:
            raise AttributeError(f"KernelLaunchParams object has no attribute '{name}'")
        self.__dict__[name] = SymInt32(value)


class ShapeExprs(list):  # type: ignore[type-arg]
    pass


class TensorDesc:
    def __init__(self, shape_expr: list[Any], dtype: DataType):
        self.shape_expr = ShapeExprs(shape_expr)
        self.dtype = dtype
        self._aliased_to: TensorDesc | None = None

    def like(self) -> TensorDesc:
        return TensorDesc(list(self.shape_expr), self.dtype)

    def aliased(self) -> TensorDesc:
        out = self.like()
        out._aliased_to = self
        return out

    def get_aliased(self) -> TensorDesc | None:
        return self._aliased_to


class AutoTuneCombination:
    def __init__(self, io_types: str, layouts: str = "LINEAR", tactics: Any = None):
        self.io_types = [s.strip() for s in io_types.split(",")]
        self.types = [str_to_data_type(t) for t in self.io_types]  # raises on a name TensorRT would refuse
        self.layouts = [s.strip() for s in layouts.split(",")]


SERIALIZABLE = (int, float, bytes, bool, str)
EMPTY = inspect.Parameter.empty
# 1-D numpy array attributes, annotated numpy.typing.NDArray[dtype] (the register docs' "SupportedAttrType")
ARRAY_DTYPES = ("int8", "int16", "int32", "int64", "float16", "float32", "float64", "bool")


def _is_array(annotation: Any) -> bool:
    """An NDArray[dtype] annotation of a supported dtype (numpy.ndarray[shape, numpy.dtype[dtype]])."""
    import numpy as np

    if typing.get_origin(annotation) is not np.ndarray:
        return False
    (dtype_arg,) = typing.get_args(typing.get_args(annotation)[1])
    return np.dtype(dtype_arg).name in ARRAY_DTYPES


class Tensor:
    """tensorrt.plugin.Tensor as an impl function receives it: shape, dtype and `__cuda_array_interface__`."""

    def __init__(self, shape: tuple[int, ...], dtype: DataType):
        self.shape = shape
        self.dtype = dtype


def _is_class(annotation: Any, cls: type) -> bool:
    """issubclass as tensorrt.plugin calls it: on a string annotation (`from __future__ import annotations`) it
    raises TypeError, as the real one does."""
    if not inspect.isclass(annotation):
        raise TypeError(f"issubclass() arg 1 must be a class, not {annotation!r}")
    return issubclass(annotation, cls)


def check_register(fn: Callable[..., Any]) -> tuple[list[str], dict[str, Any]]:
    """tensorrt.plugin's _parse_register_inputs / _parse_register_return: every argument annotated, no defaults,
    TensorDescs first, attributes of serializable builtin types or 1-D NDArray[dtype], returns TensorDesc or a tuple
    of them."""
    sig = inspect.signature(fn)
    tensors: list[str] = []
    attrs: dict[str, Any] = {}
    for name, p in sig.parameters.items():
        if p.annotation is EMPTY or p.default is not EMPTY:
            raise ValueError(f"register argument {name}: needs a type annotation and no default")
        if _is_array(p.annotation):
            attrs[name] = p.annotation
        elif _is_class(p.annotation, TensorDesc):
            if attrs:
                raise ValueError("TensorDescs args and attribute args cannot be interspersed")
            tensors.append(name)
        elif p.annotation in SERIALIZABLE and name not in ("outputs", "stream", "tactic"):
            attrs[name] = p.annotation
        else:
            raise ValueError(f"Attribute '{name}' of type {p.annotation} is not a supported serializable type")
    ret = sig.return_annotation
    outs = typing.get_args(ret) if typing.get_origin(ret) is tuple else (ret,)
    if not all(_is_class(r, TensorDesc) for r in outs):
        raise ValueError(f"Return argument is of type {ret}. Return types can only be TensorDesc or Tuple[TensorDesc].")
    return tensors, attrs


def _check_args(kind: str, fn: Callable[..., Any], reg: tuple[list[str], dict[str, Any]], tail: list[str]) -> None:
    tensors, attrs = reg
    tensor_cls = Tensor if kind == "impl" else TensorDesc  # impl gets the tensors themselves
    sig = inspect.signature(fn)
    used = []
    for name, p in sig.parameters.items():
        if p.annotation is EMPTY:
            used += [name] if name in attrs else []
        elif name == "outputs":
            if typing.get_origin(p.annotation) is not tuple or not all(
                _is_class(x, tensor_cls) for x in typing.get_args(p.annotation)
            ):
                raise ValueError(f"'outputs' should be of type Tuple[{tensor_cls.__name__}]. Received {p.annotation}.")
        elif name == "tactic" or (name == "stream" and kind == "impl"):
            _is_class(p.annotation, int) or _fail(f"'{name}' input argument should be an int")
        elif _is_array(p.annotation):
            name in attrs or _fail(f"Unexpected attribute '{name}' specified in {kind} function.")
            p.annotation == attrs[name] or _fail(f"Attribute '{name}' has a type annotation different from register's")
            used.append(name)
        elif _is_class(p.annotation, tensor_cls):
            name in tensors or _fail(f"Unexpected tensor '{name}' specified in {kind} function.")
        else:
            name in attrs or _fail(f"Unexpected attribute '{name}' specified in {kind} function.")
            p.annotation == attrs[name] or _fail(f"Attribute '{name}' has a type annotation different from register's")
            used.append(name)
    expected = [*tensors, *(n for n in attrs if n in used), *tail]
    if list(sig.parameters) != expected:
        raise ValueError(f"Signature of the {kind} function {sig} does not match the expected schema {expected}")


def _fail(message: str) -> bool:
    raise ValueError(message)


def check_aot_impl(fn: Callable[..., Any], reg: tuple[list[str], dict[str, Any]]) -> None:
    """_validate_aot_impl: (inputs, attributes in order, outputs, tactic) -> tuple[str | bytes, str | bytes,
    KernelLaunchParams, SymExprs], the return annotation mandatory."""
    _check_args("aot_impl", fn, reg, ["outputs", "tactic"])
    ret = inspect.signature(fn).return_annotation
    args = typing.get_args(ret)
    if typing.get_origin(ret) is not tuple or len(args) != 4:
        raise ValueError(f"Return annotation is {ret}. Expected tuple[str | bytes, str | bytes, ...] of 4.")
    for a in args[:2]:
        for x in typing.get_args(a) if typing.get_origin(a) in (typing.Union, types.UnionType) else (a,):
            x in (str, bytes) or _fail(f"Return annotation argument '{x}': expected 'str' or 'bytes'")
    _is_class(args[2], KernelLaunchParams) or _fail(f"'{args[2]}': expected KernelLaunchParams")
    _is_class(args[3], SymIntExprs) or _fail(f"'{args[3]}': expected a SymExprs")


def check_impl(fn: Callable[..., Any], reg: tuple[list[str], dict[str, Any]]) -> None:
    """_validate_impl: (inputs as Tensor, a subset of the attributes in order, outputs: Tuple[Tensor], stream: int,
    tactic optional) -> None."""
    sig = inspect.signature(fn)
    _check_args("impl", fn, reg, ["outputs", "stream", *(["tactic"] if "tactic" in sig.parameters else [])])
    if sig.return_annotation not in (None, EMPTY):
        raise ValueError(f"impl returns {sig.return_annotation}: expected None")


def check_autotune(fn: Callable[..., Any], reg: tuple[list[str], dict[str, Any]]) -> None:
    """_validate_autotune: (inputs, attributes in order, outputs) -> list[AutoTuneCombination], if annotated."""
    _check_args("autotune", fn, reg, ["outputs"])
    ret = inspect.signature(fn).return_annotation
    if ret is not EMPTY:
        outs = typing.get_args(ret) if typing.get_origin(ret) is list else (ret,)
        all(_is_class(r, AutoTuneCombination) for r in outs) or _fail(f"autotune returns {ret}")


def install() -> tuple[types.ModuleType, types.ModuleType, dict[str, dict[str, Callable[..., Any]]]]:
    """Put the stand-ins in sys.modules as `tensorrt` and `tensorrt.plugin`; returns them and the registry
    {kind: {plugin id: function}} their decorators fill."""
    trt = types.ModuleType("tensorrt")
    trtp = types.ModuleType("tensorrt.plugin")
    registry: dict[str, dict[str, Callable[..., Any]]] = {"register": {}, "autotune": {}, "aot_impl": {}, "impl": {}}
    schemas: dict[str, tuple[list[str], dict[str, Any]]] = {}

    def decorator(kind: str) -> Callable[[str], Callable[[Callable[..., Any]], Callable[..., Any]]]:
        def named(plugin_id: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
            def record(fn: Callable[..., Any]) -> Callable[..., Any]:
                if plugin_id in registry[kind]:
                    raise ValueError(f"{kind} for {plugin_id} registered twice")
                if kind == "register":
                    schemas[plugin_id] = check_register(fn)
                elif plugin_id not in schemas:
                    raise ValueError(f"{kind} for {plugin_id} before its register")
                elif kind == "aot_impl":
                    check_aot_impl(fn, schemas[plugin_id])
                elif kind == "impl":
                    check_impl(fn, schemas[plugin_id])
                else:
                    check_autotune(fn, schemas[plugin_id])
                registry[kind][plugin_id] = fn
                return fn

            return record

        return named

    def from_shape_expr(shape_expr: Any, dtype: DataType) -> TensorDesc:
        """tensorrt.plugin.from_shape_expr: a TensorDesc of these dims (a tuple of ints / expressions) and type."""
        return TensorDesc(list(shape_expr), dtype)

    trtp.from_shape_expr = from_shape_expr  # type: ignore[attr-defined]
    trt.DataType = DataType  # type: ignore[attr-defined]
    trt.plugin = trtp  # type: ignore[attr-defined]
    for name in ("register", "autotune", "aot_impl", "impl"):
        setattr(trtp, name, decorator(name))
    for cls in (TensorDesc, Tensor, SymInt32, SymIntExprs, KernelLaunchParams, AutoTuneCombination):
        setattr(trtp, cls.__name__, cls)
    sys.modules["tensorrt"] = trt
    sys.modules["tensorrt.plugin"] = trtp
    return trt, trtp, registry


# --- the subprocess: aot_impl on PTX compiled here ------------------------------------------------------------------


def input_descs(op: str, activation: str, pool: str, first_width: int, sink_heads: int = 0) -> list[TensorDesc]:
    """The op's six inputs with symbolic dims named after the input ("q.0"); the pool's trailing dims constant.
    With `sink_heads` (PagedAttentionSinks), a seventh: the sink logits, FP32 [sink_heads]."""
    first = "qkv" if op == "KVCacheWrite" else "q"
    names = [first, "position_ids", "context_lens", "new_lens", "block_tables", "kv_cache"]
    types_ = {"float32": "FLOAT", "float16": "HALF", "bfloat16": "BF16", "int8": "INT8", "fp8": "FP8"}
    dims = {first: 2, "position_ids": 1, "context_lens": 1, "new_lens": 1, "block_tables": 2, "kv_cache": 6}
    out = []
    for n in names:
        shape: list[Any] = [Sym(f"{n}.{i}") for i in range(dims[n])]
        dtype = DataType.INT32
        if n == first:
            shape[1], dtype = first_width, DataType[types_[activation]]
        elif n == "kv_cache":
            dtype = DataType[types_[pool]]
        out.append(TensorDesc(shape, dtype))
    if sink_heads:
        out.append(TensorDesc([sink_heads], DataType.FLOAT))
    return out


def plugin_id(op: str, a: Any) -> str:
    """The plugin TensorRT's parser meets for op's node: attention with sinks is PagedAttentionSinks
    (engine/onnx_fields.complete_plugin_fields renames it)."""
    from toolchain.engine.onnx_fields import SINKS_PLUGIN

    return f"trtbuild::{SINKS_PLUGIN if op == 'PagedAttention' and a.sinks else op}"


def run_case(case: dict[str, Any], registry: dict[str, Any], reg: Any) -> dict[str, Any]:
    from toolchain.engine.ops import OP_FIELDS, AttentionAttrs

    op, activation = case["op"], case["activation"]
    a = AttentionAttrs(**case["attrs"])
    width = (a.num_heads + 2 * a.num_kv_heads) * a.head_size if op == "KVCacheWrite" else a.num_heads * a.head_size
    sink_heads = a.num_heads if op == "PagedAttention" and a.sinks else 0
    inputs = input_descs(op, activation, "fp8" if a.kv_cache_dtype == "fp8" else a.kv_cache_dtype, width, sink_heads)
    attrs = {k: v for k, v in asdict(a).items() if k in OP_FIELDS[op]}
    out = registry["register"][plugin_id(op, a)](*inputs, **attrs)
    seen: dict[str, Any] = {}

    def compiled(op_: str, a_: Any, act_: str) -> Any:
        from toolchain.plugins.compile import compile_kernel  # the registration's own compile, cached on disk

        seen["kernel"] = compile_kernel(op_, a_, act_, case["arch"])
        return seen["kernel"]

    reg.compiled = compiled
    name, ptx, params, args = registry["aot_impl"][plugin_id(op, a)](*inputs, **attrs, outputs=(out,), tactic=0)
    env = {"q.0": case["num_tokens"], "qkv.0": case["num_tokens"]}

    def show(v: Any) -> Any:
        v = v.value if isinstance(v, SymInt32) else v
        return {"sym": v.text, "value": v.fn(env) if v.text in env else None} if isinstance(v, Sym) else v

    bad = [type(x).__name__ for x in args if not isinstance(x, SymInt32)]
    k = seen["kernel"]
    return {
        "name": name,
        "ptx": ptx,
        "grid": [show(getattr(params, f)) for f in ("grid_x", "grid_y", "grid_z")],
        "block": [show(getattr(params, f)) for f in ("block_x", "block_y", "block_z")],
        "shared_mem": show(params.shared_mem),
        "args": [show(x) for x in args],
        "args_not_symint32": bad,
        "compiled": {"name": k.name, "shared": k.shared, "num_warps": k.num_warps},
    }


def main() -> None:
    """argv[1]: a JSON list of cases {op, activation, arch, num_tokens, attrs}; prints a JSON list of results."""
    sys.path.insert(0, str(ROOT))
    _, _, registry = install()
    import importlib

    reg = importlib.import_module("toolchain.plugins.tensorrt_registration")
    cases = json.loads(sys.argv[1])
    print(json.dumps([run_case(c, registry, reg) for c in cases]))


if __name__ == "__main__":
    main()


@contextlib.contextmanager
def registered(module: str) -> Iterator[tuple[types.ModuleType, dict[str, dict[str, Callable[..., Any]]], Any]]:
    """(the tensorrt stand-in, its registry, `module` imported against it); sys.modules restored afterwards."""
    saved = {k: sys.modules.get(k) for k in ("tensorrt", "tensorrt.plugin", module)}
    sys.modules.pop(module, None)
    try:
        trt, _, registry = install()
        yield trt, registry, importlib.import_module(module)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
