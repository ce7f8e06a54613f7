"""`trtbuild diff OLD NEW`: what changed between two engines, what it cost in quality and speed, and gates on it.

A release check against what serves now. OLD and NEW are engine directories or `trtbuild run` directories (whose
`engine/` is used, and whose stage manifests tell the whole chain: source weights, quantization, build).

1. What changed, from manifests and build configs alone (no model run): source weights by input hash, the resolved
   recipes key by key, quantization, build limits, backend, engine files, software and hardware versions.
2. Quality: both engines on the same tokens; NEW against OLD directly (KLD, same top-1, PPL ratio) and, with a
   reference model, each against it; golden prompts whose greedy output changed, with the first divergence.
3. Speed: both engines replay the same trace slice in interleaved rounds; medians of output tok/s, TTFT and TPOT.
4. Gates on all of it (exit 3 in the CLI, as eval's), and report.json / .md / .html with a manifest.

Both directions are valid (diff NEW OLD is the rollback's view): every metric is defined for either order.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from toolchain import console
from toolchain.atomic import atomic_dir, check_output_dir
from toolchain.engine.api import BUILD_CONFIG, Engine, EngineSpec, load_tokenizer, open_trusted, trusted_spec
from toolchain.errors import UserError
from toolchain.evaluate.diff_report import (
    change_lines,
    quality_rows,
    spec_lines,
    speed_rows,
    summary_line,
    write_reports,
)
from toolchain.evaluate.engine_eval import EngineSession, Reference, SpecOptions, spec_golden
from toolchain.evaluate.gates import DIFF, SPEC_NEEDS, GateResult, check, check_limit
from toolchain.evaluate.golden import TokenBytes, read_golden
from toolchain.manifest import MANIFEST_NAME, StageRecord, read_manifest, sha256_file
from toolchain.quality import QualityReport, kld_histogram, summarize, token_stats
from toolchain.quantize.methods.base import QuantMethod
from toolchain.quantize.methods.registry import by_algo
from toolchain.recipe import STAGE_DIRS
from toolchain.runtime.replay import replay
from toolchain.runtime.traces import load_trace
from toolchain.text import tokenize

IGNORED_RECIPE_KEYS = ("output",)  # where a build was written is not what was built


@dataclass(frozen=True)
class DiffOptions:
    data: Path | None = None  # None: the eval data named in NEW's (else OLD's) recipe, when there is one
    max_tokens: int = 4096
    reference: Path | None = None
    golden: Path | None = None
    trace: Path | None = None
    max_requests: int = 16
    rate_scale: float = 1.0
    rounds: int = 3
    gates: tuple[tuple[str, float], ...] = ()
    changes_only: bool = False
    spec: SpecOptions | None = None  # replay the golden prompts speculating on both engines (issue 30)


@dataclass(frozen=True)
class SideInfo:
    """One side as the result names it: where it is, what kind of directory, which engine manifest."""

    path: str
    kind: str  # run | engine
    engine_dir: str
    manifest_sha256: str
    stages: list[str]  # the stage manifests found

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Side:
    """One of the two builds: where its engine is and every stage manifest that could be found."""

    label: str  # OLD | NEW
    path: Path
    kind: str  # run | engine
    engine_dir: Path
    manifests: dict[str, dict[str, Any]]  # stage -> manifest (convert, quantize, build; run for a run dir)
    spec: EngineSpec  # its build_config.json, checked against its manifest

    @property
    def recipe(self) -> dict[str, Any] | None:
        """The recipe as written (paths relative to the recipe file, so two checkouts compare equal) where the run
        recorded it, else the resolved one (absolute paths)."""
        build = self.manifests["build"]
        recipe: dict[str, Any] | None = build["details"].get("recipe_as_written") or build.get("recipe")
        return recipe

    @property
    def manifest_sha256(self) -> str:
        return sha256_file(self.engine_dir / MANIFEST_NAME)

    def describe(self) -> SideInfo:
        return SideInfo(
            path=str(self.path.resolve()),
            kind=self.kind,
            engine_dir=str(self.engine_dir.resolve()),
            manifest_sha256=self.manifest_sha256,
            stages=sorted(self.manifests),
        )


def load_side(path: Path, label: str) -> Side:
    if not path.is_dir():
        raise UserError(f"{label} {path}: no such directory; pass an engine dir or a `trtbuild run` output dir")
    if (path / BUILD_CONFIG).is_file():
        kind, engine_dir = "engine", path
    elif (path / STAGE_DIRS["build"] / BUILD_CONFIG).is_file():
        kind, engine_dir = "run", path / STAGE_DIRS["build"]
    else:
        raise UserError(
            f"{label} {path}: neither an engine dir ({BUILD_CONFIG}) nor a run dir with engine/; "
            "pass what `trtbuild build` or `trtbuild run` wrote"
        )
    if kind == "run":
        read_manifest(path)  # a run dir without its own manifest was not finished
    spec = trusted_spec(engine_dir)  # the facts below come from it and the manifests: the bytes must be as recorded
    manifests = {"build": read_manifest(engine_dir)}
    run_dir = path if kind == "run" else _enclosing_run(engine_dir)
    if run_dir is not None:
        manifests["run"] = read_manifest(run_dir)
        for stage in ("convert", "quantize"):
            if (run_dir / STAGE_DIRS[stage] / MANIFEST_NAME).is_file():
                manifests[stage] = read_manifest(run_dir / STAGE_DIRS[stage])
    else:
        manifests.update(_upstream(manifests["build"], engine_dir))
    return Side(label, path, kind, engine_dir, manifests, spec)


def _enclosing_run(engine_dir: Path) -> Path | None:
    parent = engine_dir.resolve().parent
    if engine_dir.resolve().name != STAGE_DIRS["build"] or not (parent / MANIFEST_NAME).is_file():
        return None
    try:
        return parent if read_manifest(parent).get("stage") == "run" else None
    except UserError:
        return None


def _upstream(manifest: dict[str, Any], directory: Path) -> dict[str, dict[str, Any]]:
    """Follow a standalone engine's inputs back to its quantize and convert stages, where those dirs still exist
    (a root may be absolute, or relative to the manifest's own directory)."""
    found: dict[str, dict[str, Any]] = {}
    for _ in range(2):
        dirs = {
            Path(os.path.normpath(directory / str(e["root"]) / e["path"])).parent
            for e in manifest["inputs"]
            if e.get("root")
        }
        if len(dirs) != 1 or not (next(iter(dirs)) / MANIFEST_NAME).is_file():
            break
        directory = next(iter(dirs))
        try:
            manifest = read_manifest(directory)
        except UserError:
            break
        if manifest.get("stage") not in ("convert", "quantize") or manifest["stage"] in found:
            break
        found[manifest["stage"]] = manifest
    return found


# -- what changed -------------------------------------------------------------------------------------------------


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, child in value.items():
            out.update(_flatten(child, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


class _Unknown:
    """A fact a side does not record (its stage manifest was not found): never counted as a change."""

    def __repr__(self) -> str:
        return "UNKNOWN"


UNKNOWN = _Unknown()
QUANTIZE_DETAILS = (
    "method",
    "smoothquant_alpha",
    "calibration data sha256",
    "calibration samples",
    "calibration seq_len",
    "seed",
)


def _weights(side: Side) -> dict[str, Any] | _Unknown:
    convert = side.manifests.get("convert")
    if convert is None:
        return UNKNOWN  # the whole section: the convert dir was not found
    return {e["path"]: e["sha256"] for e in convert["inputs"]}


def _weight_method(algo: Any) -> QuantMethod | None:
    """The method of a build's quant_algo; None for unquantized weights (or an algo this trtbuild does not know:
    then no method-specific field is claimed for it)."""
    try:
        return by_algo(algo) if isinstance(algo, str) and algo else None
    except UserError:
        return None


def _quantization(side: Side) -> dict[str, Any]:
    """The quantization facts; a field that does not apply to this side's method is absent (None, shown '-'), never
    config.json's default (an unquantized build has no group size, only grouped methods have one)."""
    q = side.spec.quantization
    quantized = bool(q.get("quant_algo") or q.get("kv_cache_quant_algo"))
    weights = _weight_method(q.get("quant_algo"))
    quantize = side.manifests.get("quantize")
    details = (quantize or {}).get("details") or {}
    calib = details.get("calibration") or {}
    facts = {
        "method": details.get("method") or (None if quantized else "none"),
        "quant_algo": q.get("quant_algo") or "none",
        "group_size": q.get("group_size") if weights is not None and weights.grouped else None,
        "kv_cache": side.spec.kv_cache.dtype,
        "kv_cache_quant_algo": q.get("kv_cache_quant_algo") or "none",
        "pre_quant_scale": q.get("pre_quant_scale") if weights is not None else None,
        "smoothquant_alpha": details.get("smoothquant_alpha")
        if weights is not None and weights.uses_sq_alpha
        else None,
        "exclude_modules": q.get("exclude_modules") if quantized else None,
        "calibration data sha256": calib.get("sha256"),
        "calibration samples": calib.get("samples"),
        "calibration seq_len": calib.get("seq_len"),
        "seed": calib.get("seed"),
    }
    if quantized and quantize is None:  # what only the quantize manifest says is not known for this side
        facts.update({k: UNKNOWN for k in QUANTIZE_DETAILS})
    return facts


def _build(side: Side) -> dict[str, Any]:
    spec = side.spec
    out: dict[str, Any] = {
        "backend": spec.backend,
        "dtype": spec.dtype,
        "checkpoint_dtype": spec.checkpoint_dtype,
        "architecture": spec.architecture,
        "vocab_size": spec.vocab_size,
        "num_layers": spec.num_layers,
    }
    out.update({f"limits.{k}": v for k, v in spec.limits.to_json().items()})
    out["kv_cache.block_shape"] = list(spec.kv_cache.block_shape)  # a list, as build_config.json holds it
    return out


def _engine_files(side: Side) -> dict[str, Any]:
    return {e["path"]: e["sha256"] for e in side.manifests["build"]["outputs"]}


def _versions(side: Side) -> dict[str, Any]:
    m = side.manifests["build"]
    tool, gpu = m.get("toolchain") or {}, m.get("gpu") or {}
    out = {"trtbuild": tool.get("version"), "trtbuild commit": tool.get("git_commit")}
    out.update({k: v for k, v in sorted((m.get("packages") or {}).items())})
    out.update({"gpu": gpu.get("name"), "driver": gpu.get("driver_version"), "cuda": gpu.get("cuda_version")})
    out.update({f"plan.{k}": v for k, v in sorted((side.spec.compatibility or {}).items())})
    return out


def _machine(side: Side) -> dict[str, Any]:
    """Where each stage ran (manifest.machine): context, not part of what was built (`CONTEXT_SECTIONS`)."""
    out: dict[str, Any] = {}
    for stage in ("quantize", "build"):  # where calibration ran, and where the engine was built
        if stage in side.manifests:
            host = side.manifests[stage].get("host") or {}
            out.update({f"{stage}.{k}": host.get(k) for k in ("cpu", "arch", "isa", "cpu_capability", "torch_threads")})
    return out


def _recipe(side: Side) -> dict[str, Any]:
    if side.recipe is None:
        return {"(none: built by single commands)": True}
    flat = _flatten(side.recipe)
    return {k: v for k, v in flat.items() if k.split(".")[0] not in IGNORED_RECIPE_KEYS}


SECTIONS: dict[str, Callable[[Side], dict[str, Any] | _Unknown]] = {  # the change table's order
    "weights": _weights,
    "recipe": _recipe,
    "quantization": _quantization,
    "build": _build,
    "engine files": _engine_files,
    "versions": _versions,
    "machine": _machine,
}
# Sections that say where a build was made, not what it is: a difference there is shown but is not a change, so one
# recipe built on two CPUs (byte-identical, docs/conversion.md) reads as identical builds on different machines.
CONTEXT_SECTIONS = ("machine",)


def changes(old: Side, new: Side) -> list[dict[str, Any]]:
    """Every setting of both builds, section by section; `changed` where they differ. A fact one side does not
    record is listed with `unknown` naming that side (OLD, NEW) and is never a change."""
    rows = []
    for section, facts in SECTIONS.items():
        a, b = facts(old), facts(new)
        keys = list(dict.fromkeys([*(a if isinstance(a, dict) else {}), *(b if isinstance(b, dict) else {})]))
        for key in keys or ["(not recorded)"]:
            x = a.get(key) if isinstance(a, dict) else UNKNOWN
            y = b.get(key) if isinstance(b, dict) else UNKNOWN
            unknown = [label for label, v in (("OLD", x), ("NEW", y)) if v is UNKNOWN]
            row = {"section": section, "key": key, "old": None if x is UNKNOWN else x}
            row.update(new=None if y is UNKNOWN else y, changed=not unknown and x != y)
            if section in CONTEXT_SECTIONS:
                row["context"] = True
            rows.append({**row, "unknown": unknown} if unknown else row)
    return rows


# -- quality ------------------------------------------------------------------------------------------------------


def quality_refusal(old: Side, new: Side) -> str | None:
    """Why the two engines cannot be compared token for token (from their build configs), or None."""
    a, b = ((s.spec.architecture, s.spec.vocab_size) for s in (old, new))
    if a != b:
        return (
            f"OLD is {a[0]} with a vocabulary of {a[1]}, NEW is {b[0]} with {b[1]}: different models, so KLD and "
            "top-1 are undefined; compare builds of one model, or drop --data/--golden (the change table and "
            "--trace still compare them)"
        )
    return None


def _tokens(data: Path, old: Side, new: Side, max_tokens: int) -> tuple[torch.Tensor | None, str | None]:

    a = tokenize(data, old.engine_dir, max_tokens=max_tokens)
    b = tokenize(data, new.engine_dir, max_tokens=max_tokens)
    if not torch.equal(a, b):
        return None, "OLD and NEW tokenize the evaluation text differently (their tokenizers differ)"
    return a, None


@dataclass(frozen=True)
class DiffQuality:
    """NEW scored against OLD on the same windows, and each against the reference model when one was given."""

    new_vs_old: QualityReport
    old_vs_reference: QualityReport | None
    new_vs_reference: QualityReport | None
    window: int
    kld_histogram: dict[str, Any]  # shared log10 bins: edges, and counts per comparison
    top1_by_position: dict[str, list[float]]  # per comparison

    def to_json(self, plots: bool = True) -> dict[str, Any]:
        pairs: dict[str, QualityReport | None] = {"new_vs_old": self.new_vs_old}
        pairs.update(old_vs_reference=self.old_vs_reference, new_vs_reference=self.new_vs_reference)
        out: dict[str, Any] = {name: q.to_dict() for name, q in pairs.items() if q is not None}
        out["window"] = self.window
        if plots:
            out.update(kld_histogram=self.kld_histogram, top1_by_position=self.top1_by_position)
        return out


def quality(old: Engine, new: Engine, tokens: torch.Tensor, window: int, reference: Path | None) -> DiffQuality:
    """NEW against OLD on every window of `tokens` (OLD plays the reference: KL(P_old || P_new), PPL new/old),
    and each against the reference model when given. Each model scores each window once."""

    sessions = (EngineSession(old), EngineSession(new))
    ref = Reference(reference) if reference is not None else None
    if ref is not None and (vocab := ref.model.get_input_embeddings().num_embeddings) != new.spec.vocab_size:
        raise UserError(
            f"--reference {reference}: a vocabulary of {vocab}, the engines' is {new.spec.vocab_size}; pass the "
            "Hugging Face model the engines were converted from"
        )
    count = tokens.numel() // window
    windows = tokens[: count * window].view(count, window)
    parts: dict[str, dict[str, list[torch.Tensor]]] = {}
    with console.progress("scoring both engines", count) as advance:
        for start in range(0, count, 8):
            ids = windows[start : start + 8]
            lo, ln = (s.all_logits(ids)[:, :-1] for s in sessions)
            pairs = {"new_vs_old": (lo, ln)}
            if ref is not None:
                lr = ref.all_logits(ids)[:, :-1]
                pairs.update(old_vs_reference=(lr, lo), new_vs_reference=(lr, ln))
            for name, (p, q) in pairs.items():
                for key, value in token_stats(p, q, ids[:, 1:]).items():
                    parts.setdefault(name, {}).setdefault(key, []).append(value)
            advance(len(ids))
    stats = {name: {k: torch.cat(v) for k, v in s.items()} for name, s in parts.items()}
    reports = {name: summarize(s) for name, s in stats.items()}
    return DiffQuality(
        reports["new_vs_old"],
        reports.get("old_vs_reference"),
        reports.get("new_vs_reference"),
        window,
        kld_histogram=_histograms({name: s["kld"].reshape(-1) for name, s in stats.items()}),
        top1_by_position={name: s["top1"].mean(0).tolist() for name, s in stats.items()},
    )


def _histograms(klds: dict[str, torch.Tensor]) -> dict[str, Any]:
    edges, counts = kld_histogram(list(klds.values()))
    return {"edges": edges, "counts": dict(zip(klds, counts, strict=True))}


def golden(
    old: Engine, new: Engine, path: Path, spec: SpecOptions | None = None
) -> tuple[list[dict[str, Any]] | None, str | None, dict[str, Any] | None]:
    """Greedy continuations of each prompt by both engines; where NEW's output differs, the first token that does.
    (None, why, None) when the two tokenizers make different prompts. With `spec`, each engine replays them again
    speculating (engine_eval.spec_golden, against its own greedy output): {"old": ..., "new": ...}."""

    items = read_golden(path)
    toks = [load_tokenizer(e.spec.engine_dir) for e in (old, new)]
    render = TokenBytes(toks[0]).render  # bytes that are not valid UTF-8 shown as escapes, as eval's report does
    prompts, new_prompts = ([t(item.prompt, add_special_tokens=True)["input_ids"] for item in items] for t in toks)
    if prompts != new_prompts:
        return None, f"OLD and NEW tokenize the prompts of {path} differently (their tokenizers differ)", None
    for item, ids in zip(items, prompts, strict=True):
        if not ids:
            raise UserError(f"{path}: prompt {item.prompt!r} tokenizes to nothing; give it some text")
    lengths = [item.max_new_tokens for item in items]
    outs = [EngineSession(e).greedy(prompts, lengths) for e in (old, new)]
    results = []
    for item, a, b in zip(items, *outs, strict=True):
        diverge = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if diverge is None and len(a) != len(b):
            diverge = min(len(a), len(b))
        results.append(
            {
                "prompt": item.prompt,
                "same": diverge is None,
                "first_divergence": diverge,
                "old": render(a),
                "new": render(b),
                "old_tokens": a,
                "new_tokens": b,
            }
        )
    speculative = None
    if spec is not None:
        console.info(f"replaying {len(prompts)} golden prompts speculating ({spec.config.method}) on both engines")
        speculative = {
            side: spec_golden(engine, prompts, lengths, out, spec)
            for side, engine, out in (("old", old, outs[0]), ("new", new, outs[1]))
        }
    return results, None, speculative


# -- speed --------------------------------------------------------------------------------------------------------


def speed(old: Engine, new: Engine, trace: Path, opts: DiffOptions) -> dict[str, Any]:
    """Both engines replay the same trace slice (lengths fitted to the smaller engine) in `rounds` interleaved
    rounds, the order alternating, after one warm-up each; per engine the median of the rounds."""

    engines = {"old": old, "new": new}
    max_seq = min(e.spec.limits.max_seq_len for e in engines.values())
    vocab = min(e.vocab_size for e in engines.values())
    requests, scale = load_trace(trace, max_seq, vocab, opts.max_requests, opts.rate_scale)
    console.info(f"replaying {len(requests)} requests of {trace.name} on both engines, {opts.rounds} rounds")
    for engine in engines.values():  # warm-up: sessions, allocator, caches
        replay(engine, [replace(r, arrival=0.0) for r in requests[:2]])
    rounds: dict[str, list[dict[str, Any]]] = {"old": [], "new": []}
    for round_ in range(opts.rounds):
        for side in ("old", "new") if round_ % 2 == 0 else ("new", "old"):
            r = replay(engines[side], requests)
            if r["completed"] < r["requests"]:
                lost = r["requests"] - r["completed"]
                why = "; ".join(r["errors"]) or "no reason given"
                raise UserError(
                    f"{side.upper()} engine: {lost} of {r['requests']} trace requests did not complete: {why}"
                )
            rounds[side].append({k: v for k, v in r.items() if k != "kv_utilization"})
    summary = {side: _median_round(rs) for side, rs in rounds.items()}
    ratios = {"throughput_ratio": _ratio(summary["new"]["output_tok_s"], summary["old"]["output_tok_s"])}
    for metric in ("ttft", "tpot"):
        for p in ("p50", "p90"):
            ratios[f"{metric}_{p}_ratio"] = _ratio(summary["new"][f"{metric}_s"][p], summary["old"][f"{metric}_s"][p])
    return {
        "trace": str(trace.resolve()),
        "requests": len(requests),
        "length_scale": scale,
        "rate_scale": opts.rate_scale,
        "rounds": opts.rounds,
        **summary,
        "ratios": ratios,
        "per_round": rounds,
    }


def _median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    def med(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return statistics.median(present) if present else None

    out: dict[str, Any] = {"output_tok_s": med([r["output_tok_s"] for r in rounds])}
    for metric in ("ttft_s", "tpot_s", "queue_s"):
        out[metric] = {p: med([r[metric][p] for r in rounds]) for p in ("p50", "p90", "p99")}
    out["output_tokens"] = rounds[0]["output_tokens"]
    return out


def _ratio(new: float | None, old: float | None) -> float | None:
    return None if new is None or not old else new / old


# -- gates and the whole diff -------------------------------------------------------------------------------------


def check_gate_names(gates: dict[str, float], opts: DiffOptions, have_data: bool) -> None:
    """Everything a user can get wrong about gates, before any work."""
    available = {"--data": have_data, "--golden": opts.golden is not None, "--trace": opts.trace is not None}
    available[SPEC_NEEDS] = opts.golden is not None and opts.spec is not None
    for gate, limit in gates.items():
        needs = check_limit(gate, limit, DIFF).needs
        if opts.changes_only or not available[needs]:
            why = "--changes-only runs no model" if opts.changes_only else f"pass {needs}"
            raise UserError(f"gate {gate} needs {DIFF[gate].metric}, which this diff would not compute; {why}")


def check_gates(gates: dict[str, float], metrics: dict[str, float | None]) -> list[GateResult]:
    return check(gates, metrics, DIFF)


def default_data(old: Side, new: Side) -> Path | None:
    """The eval data named in NEW's recipe, else OLD's, when that file is here."""
    for side in (new, old):
        data = ((side.recipe or {}).get("eval") or {}).get("data")
        if data and Path(data).is_file():
            return Path(data)
    return None


def load_pair(old_dir: Path, new_dir: Path) -> tuple[Side, Side]:
    if old_dir.resolve() == new_dir.resolve():
        raise UserError(
            f"OLD and NEW are the same directory ({old_dir.resolve()}): nothing to compare; pass the released "
            "engine as OLD and the candidate as NEW"
        )
    old, new = load_side(old_dir, "OLD"), load_side(new_dir, "NEW")
    if old.engine_dir.resolve() == new.engine_dir.resolve():
        raise UserError(f"OLD and NEW hold the same engine ({old.engine_dir.resolve()}): nothing to compare")
    return old, new


@dataclass(frozen=True)
class DiffResult:
    """The whole comparison (see the module docstring): the change table, then what the models showed."""

    old: SideInfo
    new: SideInfo
    changes: list[dict[str, Any]]  # per setting: section, key, old, new, changed (and unknown, context)
    changed: int
    unknown: int
    same_build: bool
    same_machine: bool
    data: str | None
    quality: DiffQuality | None = None
    quality_refused: str | None = None  # why quality was not compared (two different models, tokenizers)
    golden: list[dict[str, Any]] | None = None
    golden_same: float | None = None
    speculative: dict[str, Any] | None = None  # {"old", "new"}: engine_eval.spec_golden's records; None without it
    speed: dict[str, Any] | None = None
    gates: list[GateResult] | None = None  # None: not checked yet (the change table alone, `on_changes`)
    passed: bool = True
    report_dir: str | None = None

    def to_json(self, plots: bool = True) -> dict[str, Any]:
        """report.json's content (with `report_dir` once written); `plots=False`: without the quality plots (in
        report.json; too long for a terminal)."""
        out: dict[str, Any] = {
            "old": self.old.to_json(),
            "new": self.new.to_json(),
            "changes": self.changes,
            "changed": self.changed,
            "unknown": self.unknown,
            "same_build": self.same_build,
            "same_machine": self.same_machine,
            "data": self.data,
            "quality": self.quality.to_json(plots) if self.quality else None,
            "quality_refused": self.quality_refused,
            "golden": self.golden,
            "golden_same": self.golden_same,
            "speed": self.speed,
        }
        if self.speculative is not None:
            out["speculative"] = self.speculative
        if self.gates is not None:
            out.update(gates=[g.to_json() for g in self.gates], passed=self.passed)
        if self.report_dir is not None:
            out["report_dir"] = self.report_dir
        return out

    def change_lines(self, old: Path, new: Path) -> list[str]:
        """The change table as printed before any model runs; `old`, `new`: the directories as the user named them."""
        r = self.to_json()
        lines = [f"diff {old} -> {new}", f"  {summary_line(r)}"]
        return lines + [f"  {s:<13}{k:<32} {a} -> {b}" for s, k, a, b in change_lines(r)]

    def lines(self) -> list[str]:
        """What the models showed, and the gates: printed after the change table."""
        lines = []
        if self.quality is not None:
            lines.append(f"  quality on {self.quality.new_vs_old.tokens:,} tokens of {self.data}")
            lines += [f"    {k:<36} {v}" for k, v in quality_rows(self.quality.to_json())]
        if self.golden is not None:
            lines.append(f"  golden prompts: {sum(g['same'] for g in self.golden)} of {len(self.golden)} unchanged")
            lines += [
                f"    changed at token {g['first_divergence']}: {g['prompt']!r}" for g in self.golden if not g["same"]
            ]
        if self.speculative is not None:
            lines += ["  " + line for line in spec_lines(self.speculative)]
        if self.speed is not None:
            s = self.speed
            lines.append(
                f"  speed: {s['requests']} requests of {Path(s['trace']).name}, {s['rounds']} interleaved rounds"
            )
            lines.append(f"    {'':<14}{'OLD':>10}{'NEW':>10}{'NEW/OLD':>10}")
            lines += [f"    {a:<14}{b:>10}{c:>10}{d:>10}" for a, b, c, d in speed_rows(s)]
        lines += [
            f"  gate {g.gate:<21} {'-' if g.value is None else format(g.value, '.6g')} vs {g.limit:g}: "
            f"{'pass' if g.passed else 'FAIL'}"
            for g in self.gates or []
        ]
        if self.report_dir:
            lines.append(f"  report -> {self.report_dir} (report.md, report.html, report.json)")
        return lines


def diff(
    old_dir: Path, new_dir: Path, opts: DiffOptions, on_changes: Callable[[DiffResult], None] | None = None
) -> DiffResult:
    """The whole comparison (see the module docstring). `on_changes` sees the change table as soon as
    it is known, before any model runs. Quality refused for two different models: `quality_refused` says why."""
    old, new = load_pair(old_dir, new_dir)
    refusal = quality_refusal(old, new)
    comparable = refusal is None and not opts.changes_only
    data = opts.data or (default_data(old, new) if comparable else None)  # a recipe's eval data, where it is used
    gates = dict(opts.gates)
    check_gate_names(gates, opts, data is not None)
    for path, what in ((opts.data, "--data"), (opts.golden, "--golden"), (opts.trace, "--trace")):
        if path is not None and not path.is_file():
            raise UserError(f"{what} {path}: no such file")
    if opts.spec is not None:
        if opts.golden is None or opts.changes_only:
            raise UserError("speculation is measured on the golden prompts: pass --golden PROMPTS.jsonl")
        opts.spec.check()
    if opts.reference is not None and not (opts.reference / "config.json").is_file():
        raise UserError(f"--reference {opts.reference}: not a Hugging Face model dir (no config.json)")
    model_options = {"--data": opts.data, "--reference": opts.reference, "--golden": opts.golden, "--trace": opts.trace}
    asked = [name for name, value in model_options.items() if value is not None]
    if opts.changes_only and asked:
        raise UserError(f"--changes-only runs no model, so {', '.join(asked)} would be ignored; drop one or the other")
    if opts.reference is not None and data is None:
        raise UserError(f"--reference {opts.reference}: both engines are scored against it on --data; pass --data")
    rows = changes(old, new)
    built = [r for r in rows if not r.get("context")]
    result = DiffResult(
        old=old.describe(),
        new=new.describe(),
        changes=rows,
        changed=sum(r["changed"] for r in built),
        unknown=sum("unknown" in r for r in built),
        same_build=not any(r["changed"] or "unknown" in r for r in built),
        same_machine=not any(r["changed"] for r in rows if r.get("context")),
        data=str(data.resolve()) if data else None,
        quality_refused=refusal if opts.data or opts.golden else None,  # asked for, and refused
    )
    if on_changes is not None:
        on_changes(result)
    if not opts.changes_only:
        result = _run_models(old, new, data, opts, result)
    metrics: dict[str, float | None] = {"golden_same": result.golden_same}
    if result.speculative is not None:
        new_spec, old_spec = result.speculative["new"], result.speculative["old"]
        metrics.update(spec_equal=new_spec["spec_equal"], acceptance_rate=new_spec["acceptance_rate"])
        metrics["acceptance_ratio"] = _ratio(new_spec["acceptance_rate"], old_spec["acceptance_rate"])
    if result.quality is not None:
        metrics.update(result.quality.new_vs_old.to_dict())
    if result.speed is not None:
        metrics.update(result.speed["ratios"])
    checked = _old_accepted_nothing(check_gates(gates, metrics), result.speculative)
    return replace(result, gates=checked, passed=all(g.passed for g in checked))


def _old_accepted_nothing(checked: list[GateResult], speculative: dict[str, Any] | None) -> list[GateResult]:
    """OLD accepted nothing: no acceptance ratio exists and NEW cannot have fallen below OLD; that gate passes,
    valued None."""
    if speculative is None or speculative["old"]["acceptance_rate"] != 0:
        return checked
    return [
        replace(g, passed=True) if g.gate == "acceptance_ratio_vs_old_min" and g.value is None else g for g in checked
    ]


def _run_models(old: Side, new: Side, data: Path | None, opts: DiffOptions, result: DiffResult) -> DiffResult:
    if data is None and opts.golden is None and opts.trace is None:
        return result  # nothing asked of the models: the change table is the whole diff
    # both were checked against their manifests in load_side: opened here without hashing them again
    engines = open_trusted(old.spec), open_trusted(new.spec)
    refusal = result.quality_refused  # two different models; the speed of those is still comparable
    scored, replayed, same, speculative = None, None, None, None
    if refusal is None and data is not None:
        tokens, refusal = _tokens(data, old, new, opts.max_tokens)
        if tokens is not None:
            window = min(256, *(e.spec.limits.max_seq_len for e in engines))
            if tokens.numel() < window:
                raise UserError(
                    f"{data}: {tokens.numel()} tokens, fewer than one window of {window}; raise --max-tokens or "
                    "give more text"
                )
            console.info(f"scoring both engines on {tokens.numel():,} tokens of {data} in windows of {window}")
            scored = quality(*engines, tokens, window, opts.reference)
    if refusal is None and opts.golden is not None:
        replayed, refusal, speculative = golden(*engines, opts.golden, opts.spec)
        if replayed is not None:
            same = sum(g["same"] for g in replayed) / len(replayed)
    timed = speed(*engines, opts.trace, opts) if opts.trace is not None else None
    # quality_refused: or the tokenizers differ
    return replace(
        result,
        quality=scored,
        quality_refused=refusal,
        golden=replayed,
        golden_same=same,
        speculative=speculative,
        speed=timed,
    )


def run_diff(
    old_dir: Path,
    new_dir: Path,
    opts: DiffOptions,
    out_dir: Path | None = None,
    force: bool = False,
    on_changes: Callable[[DiffResult], None] | None = None,
    record: StageRecord | None = None,
    new_label: Path | None = None,
) -> DiffResult:
    """`diff`, then report.json / .md / .html and a manifest in `out_dir` (atomically) when given. `new_label`:
    where NEW's engine will live, when it is still being written elsewhere (a recipe run)."""

    if out_dir is not None:
        check_output_dir(out_dir, force, inputs=(old_dir, new_dir))
    record = record or StageRecord("diff")  # started now: its wall time is the diff's
    result = diff(old_dir, new_dir, opts, on_changes)
    if new_label is not None:
        result = replace(result, new=replace(result.new, path=str(new_label), engine_dir=str(new_label)))
    if out_dir is None:
        return result
    record.details.update(
        old_manifest_sha256=result.old.manifest_sha256,
        new_manifest_sha256=result.new.manifest_sha256,
        changed=result.changed,
        gates=None if result.gates is None else [g.to_json() for g in result.gates],
        passed=result.passed,
    )
    with atomic_dir(out_dir, force, inputs=(old_dir, new_dir)) as tmp:
        for engine_dir in (load_side(old_dir, "OLD").engine_dir, load_side(new_dir, "NEW").engine_dir):
            record.add_inputs(engine_dir, [engine_dir / MANIFEST_NAME, engine_dir / BUILD_CONFIG])
        for path in (result.data and Path(result.data), opts.golden, opts.trace):
            if path:
                record.add_inputs(path.parent, [path])
        write_reports(result.to_json(), tmp)
        record.write(tmp)
    return replace(result, report_dir=str(out_dir.resolve()))


# -- `trtbuild run` with eval.baseline ----------------------------------------------------------------------------


def _recipe_gates(section: Any) -> tuple[tuple[str, float], ...]:
    return tuple((k, v) for k, v in section.gates.model_dump().items() if v is not None and k in DIFF)


@dataclass(frozen=True)
class BaselineSettings:
    """What a recipe's diff stage depends on: the settings part of its cache key."""

    baseline_manifest_sha256: str  # the released engine by its manifest, not its path
    max_tokens: int
    gates: tuple[tuple[str, float], ...]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class BaselineDiff:
    """The recipe's diff stage, as a run reports it: the baseline, the quality NEW vs OLD, and its gates."""

    baseline: str
    baseline_manifest_sha256: str
    changed: int
    quality: dict[str, Any] | None  # {"new_vs_old": QualityReport dict}, or None without eval data
    golden_same: float | None
    gates: list[GateResult]
    passed: bool

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "gates": [g.to_json() for g in self.gates]}


def baseline_settings(section: Any) -> BaselineSettings | None:
    """What a recipe's diff stage depends on (its cache key's settings), or None without `eval.baseline`; checked
    before any stage runs. `section`: the recipe's EvalSection."""
    gates = _recipe_gates(section)
    if section.baseline is None:
        if gates:
            raise UserError(
                f"recipe eval.gates.{gates[0][0]} compares the engine with a released one: add `baseline: PATH` "
                "(an engine or run dir) to the eval section, or remove the gate"
            )
        return None
    if section.golden is None and "golden_same_min" in dict(gates):
        raise UserError(
            "recipe eval.gates.golden_same_min compares golden outputs with the baseline's: add `golden: FILE.jsonl` "
            "(prompts) to the eval section, or remove the gate"
        )
    side = load_side(section.baseline, "eval.baseline")
    return BaselineSettings(side.manifest_sha256, section.max_tokens, gates)


def baseline_stage(
    section: Any, engine_dir: Path, out_dir: Path, record: StageRecord, engine_label: Path
) -> BaselineDiff:
    """The recipe's diff stage: `trtbuild diff BASELINE ENGINE` on the eval data and golden prompts, its gates,
    and the report in `out_dir`. `engine_label`: where the engine will live once the run dir is renamed."""
    assert section is not None and section.baseline is not None
    opts = DiffOptions(data=section.data, max_tokens=section.max_tokens, golden=section.golden)
    opts = replace(opts, gates=_recipe_gates(section))
    result = run_diff(section.baseline, engine_dir, opts, out_dir, record=record, new_label=engine_label)
    if result.quality_refused:
        raise UserError(f"eval.baseline {section.baseline}: quality comparison refused: {result.quality_refused}")
    quality = {"new_vs_old": result.quality.new_vs_old.to_dict()} if result.quality else None
    return BaselineDiff(
        baseline=result.old.path,
        baseline_manifest_sha256=result.old.manifest_sha256,
        changed=result.changed,
        quality=quality,
        golden_same=result.golden_same,
        gates=result.gates or [],
        passed=result.passed,
    )
