"""The PTX text Triton emits, made into what TensorRT's ahead-of-time plugin launches: the one place that knows
about Triton's hidden kernel parameters, and the reader of ptxas' resource report. Pure text functions (no Triton,
no GPU), so the tests exercise them on hand-written PTX too.

Triton 3.9 appends two `.param .u64 .ptr .global` parameters to every kernel entry, after the parameters of the
signature: the global scratch and the profile scratch buffers, which Triton's own launcher allocates and passes.
TensorRT's `aot_impl` launches the entry with exactly the plugin's input pointers, its int32 extra arguments and its
output pointers, nothing after them: `strip_hidden_params` removes the two from the entry declaration, and refuses
a kernel whose body reads either (it needs scratch memory TensorRT cannot give it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from toolchain.errors import UserError

HIDDEN_PARAMS = ("global scratch", "profile scratch")  # what Triton 3.9 appends, in order

_ENTRY = re.compile(r"\.visible\s+\.entry\s+(?P<name>[A-Za-z_$][\w$]*)\s*\((?P<params>[^)]*)\)", re.S)
_TYPE = re.compile(r"\.[usbf](8|16|32|64)")
_VERSION = re.compile(r"^\s*\.version\s+(\d+\.\d+)", re.M)
_TARGET = re.compile(r"^\s*\.target\s+(\w+)", re.M)


class ScratchError(UserError):
    """The kernel uses a hidden scratch parameter: TensorRT would launch it without that buffer."""


@dataclass(frozen=True)
class Param:
    name: str
    type: str  # the PTX type: u64 (a pointer), u32 (an int32 scalar) ...
    pointer: bool  # declared `.ptr` (Triton marks every pointer argument so)

    def __str__(self) -> str:
        return f"{self.type}{' ptr' if self.pointer else ''}"


def entry(ptx: str) -> tuple[str, list[Param]]:
    """(name, parameters) of the PTX's one kernel entry."""
    found = list(_ENTRY.finditer(ptx))
    if len(found) != 1:
        raise ValueError(f"expected one .visible .entry in the PTX, found {len(found)}")
    m = found[0]
    params = []
    for part in m["params"].split(","):
        tokens = part.split()
        if not tokens:  # an entry without parameters
            continue
        kinds = [t[1:] for t in tokens[1:-1] if _TYPE.fullmatch(t)]
        if tokens[0] != ".param" or len(kinds) != 1:
            raise ValueError(f"entry {m['name']}: unreadable parameter {part.strip()!r}")
        params.append(Param(tokens[-1], kinds[0], ".ptr" in tokens))
    return m["name"], params


def version(ptx: str) -> str:
    """The PTX ISA version the text declares (`.version 8.0` -> "8.0")."""
    m = _VERSION.search(ptx)
    if not m:
        raise ValueError("no .version directive in the PTX")
    return m.group(1)


def target(ptx: str) -> str:
    m = _TARGET.search(ptx)
    if not m:
        raise ValueError("no .target directive in the PTX")
    return m.group(1)


def strip_hidden_params(ptx: str, num_params: int) -> str:
    """The PTX with the entry's trailing hidden parameters (after its `num_params` own) removed from the
    declaration. Refuses, naming the kernel and the parameter, an entry that does not end with exactly
    len(HIDDEN_PARAMS) `.u64 .ptr` parameters, or whose text uses one of them anywhere but its declaration."""
    name, params = entry(ptx)
    hidden = params[num_params:]
    if len(params) != num_params + len(HIDDEN_PARAMS) or any(p.type != "u64" or not p.pointer for p in hidden):
        got = ", ".join(str(p) for p in hidden) or "none"
        raise ValueError(
            f"kernel {name}: {len(params)} PTX parameters where its signature has {num_params}; expected the "
            f"{len(HIDDEN_PARAMS)} hidden u64 pointers Triton 3.9 appends ({', '.join(HIDDEN_PARAMS)}), found {got}: "
            "has the pinned Triton changed its kernel ABI?"
        )
    m = _ENTRY.search(ptx)
    assert m is not None  # entry() found it
    body = ptx[: m.start("params")] + ptx[m.end("params") :]
    for p, what in zip(hidden, HIDDEN_PARAMS, strict=True):
        if re.search(rf"(?<![\w$]){re.escape(p.name)}(?![\w$])", body):
            raise ScratchError(
                f"kernel {name} reads its {what} parameter {p.name}: it needs a scratch buffer, which TensorRT's "
                "ahead-of-time launch cannot pass (only the plugin's inputs, int32 arguments and outputs); change the "
                "kernel so Triton allocates no scratch (metadata global_scratch_size and profile_scratch_size 0)"
            )
    kept = m["params"].split(",")[:num_params]
    return ptx[: m.start("params")] + ",".join(kept).rstrip() + "\n" + ptx[m.end("params") :]


@dataclass(frozen=True)
class PtxasReport:
    """What `ptxas -v` says of one entry: registers, spill bytes, static shared memory, stack frame."""

    registers: int
    spill_stores: int
    spill_loads: int
    static_shared_bytes: int
    stack_bytes: int


_FUNCTION = re.compile(
    r"Compiling entry function '(?P<name>[\w$]+)' for '(?P<arch>\w+)'.*?"
    r"(?P<stack>\d+) bytes stack frame, (?P<stores>\d+) bytes spill stores, (?P<loads>\d+) bytes spill loads.*?"
    r"Used (?P<registers>\d+) registers(?P<rest>[^\n]*)",
    re.S,
)


def parse_ptxas(log: str, name: str) -> PtxasReport:
    """ptxas' verbose report of entry `name`."""
    for m in _FUNCTION.finditer(log):
        if m["name"] == name:
            smem = re.search(r"(\d+) bytes smem", m["rest"])
            return PtxasReport(
                registers=int(m["registers"]),
                spill_stores=int(m["stores"]),
                spill_loads=int(m["loads"]),
                static_shared_bytes=int(smem.group(1)) if smem else 0,
                stack_bytes=int(m["stack"]),
            )
    raise ValueError(f"ptxas -v reported nothing for entry {name}: {log.strip()[:300]!r}")
