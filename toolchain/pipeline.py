"""`trtbuild run`: execute a recipe's stages — convert, then quantize, build and eval when the recipe has those
sections — into one output directory.

Layout: `recipe.yaml` (the resolved recipe), one sub-directory per stage (`checkpoint/`, `quantized/`, `engine/`,
`report/`), each with its own manifest, and a top-level manifest over all of it.

Stages are cached: each stage's manifest records a key, the sha256 of its settings, its input files' contents,
trtbuild's own code and the key of the stage it reads from. Re-running a recipe into the same output reuses every
stage whose key is unchanged (hard links, no copy) and redoes the rest — an unchanged re-run does nothing and says
so; changing only
the gates re-runs only eval. `--force` rebuilds every stage. The directory is still replaced atomically: a failed
run leaves the previous output as it was.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from toolchain import __version__, console
from toolchain.atomic import atomic_dir
from toolchain.checkpoint.convert import ConvertResult, convert
from toolchain.engine.build import BuildOptions, build_engine
from toolchain.engine.results import BuildResult
from toolchain.errors import UserError
from toolchain.evaluate.diff import baseline_settings, baseline_stage
from toolchain.evaluate.engine_eval import run_eval
from toolchain.evaluate.gates import DIFF as DIFF_GATES
from toolchain.evaluate.report import summary_lines
from toolchain.evaluate.results import PLOTS as EVAL_PLOTS
from toolchain.evaluate.results import EvalResult
from toolchain.integrity import cached_hasher
from toolchain.manifest import StageRecord, is_artifact, read_manifest, sha256_file, verify, write_manifest
from toolchain.quantize.results import QuantizeResult
from toolchain.quantize.stage import QuantizeOptions, quantize_checkpoint
from toolchain.recipe import STAGE_DIRS, BuildSection, DraftSection, LoadedRecipe, QuantizeSection, Recipe
from toolchain.runtime.speculative import SpecConfig


def _digest(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _files(*paths: Path | None) -> list[dict[str, str] | None]:
    """Content hashes of input files (every file of a directory, not recursing), one mapping per path, keyed by
    file name: where the inputs live is no part of a cache key, what they hold and what they are called is."""
    out: list[dict[str, str] | None] = []
    for path in paths:
        if path is None:
            out.append(None)
            continue
        files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
        out.append({f.name: sha256_file(f) for f in files if f.exists()})
    return out


def _code_digest() -> str:
    """trtbuild's own code (Python and CUDA sources): a stage made by other code is not reused."""
    root = Path(__file__).resolve().parent.parent
    files = sorted([*root.glob("toolchain/**/*.py"), *root.glob("plugins/*.cu")])
    digest = hashlib.sha256()
    for f in files:
        digest.update(f"{f.relative_to(root).as_posix()}\0{f.stat().st_size}\0".encode())
        digest.update(f.read_bytes())
    return digest.hexdigest()


def _stage_keys(recipe: Recipe) -> dict[str, str]:
    """Every stage's cache key, chained: a stage's key includes the key of the stage it reads."""
    m = recipe.model
    convert = (m.dtype, m.allow_pickle, recipe.convert.tp, recipe.convert.pp)
    keys = {"convert": _digest(__version__, _code_digest(), convert, _files(m.path))}
    upstream = keys["convert"]
    if recipe.quantize is not None:
        q = recipe.quantize
        settings = q.model_dump(mode="json", exclude={"calib_data", "eval_data"})
        keys["quantize"] = _digest(upstream, recipe.seed, settings, _files(q.calib_data, q.eval_data))
        upstream = keys["quantize"]
    if recipe.build is not None:
        keys["build"] = _digest(upstream, recipe.build.model_dump(mode="json"), _machine(recipe.build))
        upstream = keys["build"]
    draft = recipe.speculative.draft_section() if recipe.speculative is not None else None
    if draft is not None:  # its own chain: the draft reads the model (or its own), none of the target's stages
        b = draft_build(recipe, draft)
        dq = draft.quantize
        settings = draft.model_dump(mode="json", exclude={"model": True, "build": True, "quantize": QUANTIZE_FILES})
        quantize = (recipe.seed, _files(dq.calib_data, dq.eval_data)) if dq is not None else None
        inputs = _files(draft.model or m.path)
        keys["draft"] = _digest(
            __version__,
            _code_digest(),
            m.dtype,
            m.allow_pickle,
            settings,
            quantize,
            inputs,
            b.model_dump(),
            _machine(b),
        )
    if recipe.eval is not None:
        e = recipe.eval
        own: dict[str, Any] = {"data": True, "golden": True, "baseline": True, "gates": set(DIFF_GATES)}  # diff's
        settings = e.model_dump(mode="json", exclude=own)
        inputs = _files(e.data, e.golden)  # hashed once for both stages
        spec = recipe.speculative.model_dump(mode="json", exclude={"draft"}) if recipe.speculative else None
        keys["eval"] = _digest(upstream, settings, inputs, *([spec, keys.get("draft")] if spec else []))
        diff_settings = baseline_settings(e)  # the diff against the released engine: by its manifest, not its path
        if diff_settings is not None:
            keys["diff"] = _digest(upstream, diff_settings.to_json(), inputs)
    return keys


QUANTIZE_FILES = {"calib_data": True, "eval_data": True}  # a quantize section's inputs: hashed, not named


def _machine(build: BuildSection) -> dict[str, Any]:
    """What `auto` resolves to here, and what a plan is tied to: inputs of a build too."""
    from toolchain.engine import tensorrt_backend

    machine: dict[str, Any] = {"tensorrt": tensorrt_backend.available() is None}
    if machine["tensorrt"] and build.backend != "onnxruntime":
        machine.update(tensorrt_backend.versions())
    return machine


def draft_build(recipe: Recipe, draft: DraftSection) -> BuildSection:
    """The draft's build settings: the target's, with the keys the draft's own `build:` sets (runtime/draft.py
    check_draft refuses a draft with smaller limits or another block size, so those default to the target's)."""
    if recipe.build is None:
        raise UserError("speculative: the draft engine is built beside the target: add a 'build:' section")
    own = draft.build
    if own is None:
        return recipe.build
    update = {k: getattr(own, k) for k in own.model_fields_set}
    if update.get("tokens_per_block", recipe.build.tokens_per_block) != recipe.build.tokens_per_block:
        raise UserError(
            f"speculative.draft.build.tokens_per_block {own.tokens_per_block}: the draft's KV pool is indexed by "
            f"the target's blocks, so it must be build.tokens_per_block ({recipe.build.tokens_per_block}); drop it"
        )
    return recipe.build.model_copy(update=update)


def default_report_dir(engine_dir: Path) -> Path:
    """Where `trtbuild eval` writes without -o: ENGINE-report beside the engine, or, for the engine of a run dir,
    RUN-engine-report beside the run dir (a report inside a run dir would make `verify` of it fail)."""
    engine = engine_dir.resolve()
    parent = engine.parent
    if is_artifact(parent) and read_manifest(parent)["stage"] == "run":
        return parent.with_name(f"{parent.name}-{engine.name}-report")
    return engine.with_name(f"{engine.name}-report")


def _reuse(previous: Path | None, stage: str, key: str, tmp: Path) -> dict[str, Any] | None:
    """Hard-link the previous run's stage dir into `tmp` when its key matches; its summary, or None."""
    if previous is None:
        return None
    src = previous / STAGE_DIRS[stage]
    try:
        manifest = read_manifest(src)
    except UserError:
        return None
    if manifest["details"].get("cache_key") != key:
        return None
    problems = verify(src, hasher=cached_hasher())  # a file edited, added or removed since: not reusable
    if problems:
        console.warn(f"{stage}: {src} is not as it was written ({problems[0]}); running the stage again")
        return None

    def link_or_copy(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:  # a filesystem without hard links
            shutil.copy2(a, b)

    shutil.copytree(src, tmp / STAGE_DIRS[stage], copy_function=link_or_copy)
    summary: dict[str, Any] = manifest["details"].get("summary") or {}
    return {**summary, "cached": True}


# what a stage's summary in the run leaves out of its result: eval's plots and report dir (the run has its own)
SUMMARY_LEFT_OUT = (*EVAL_PLOTS, "report_dir")


class _StageResult(Protocol):
    def to_json(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class RunResult:
    """What `trtbuild run` did: each stage's summary (as its manifest keeps it: a reused stage reports what it did
    when it ran), which stages ran again, whether the gates passed, and the run's own files."""

    output_dir: str
    recipe: str
    recipe_sha256: str
    stages: dict[str, dict[str, Any]]  # stage -> its result's JSON less its files; "cached": True when reused
    rerun: list[str]
    passed: bool
    outputs: list[dict[str, Any]]  # the run manifest's file entries: path, size, sha256
    warnings: list[str]
    wall_time_s: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def lines(self) -> list[str]:
        lines = [f"ran {self.recipe} -> {self.output_dir}", f"  recipe sha256 {self.recipe_sha256}"]
        for name, stage in self.stages.items():
            reused = " (unchanged, reused)" if stage.get("cached") else ""
            lines.append(f"  {name:<9}{reused}{_stage_line(name, stage)}")
        if self.stages.get("eval", {}).get("quality"):
            lines += ["    " + line for line in summary_lines(self.stages["eval"])]
        size = sum(e["size"] for e in self.outputs)
        lines.append(f"  {len(self.outputs)} files, {size:,} B, {self.wall_time_s:.2f} s")
        return lines


def _stage_line(name: str, s: dict[str, Any]) -> str:
    """One stage's summary (fresh or from a reused stage's manifest) on the line after its name."""
    if name == "convert":
        return f" {s.get('architecture')}, {s.get('dtype')}, {s.get('num_parameters', 0):,} parameters"
    if name == "quantize":
        return f" {s.get('quant_algo')}, kv cache {s.get('kv_cache_quant_algo') or 'unquantized'}"
    if name in ("build", "draft"):
        return f" backend {s.get('backend')}, {s.get('dtype')}"
    if name == "eval":
        q = s.get("quality") or {}
        return f" mean KLD {q.get('kld_mean', float('nan')):.6f}, {'PASS' if s.get('passed') else 'REGRESSION'}"
    if name == "diff":
        q = (s.get("quality") or {}).get("new_vs_old") or {}
        failed = [g["gate"] for g in s.get("gates", []) if not g["pass"]]
        verdict = f"REGRESSION ({', '.join(failed)})" if failed else "PASS"
        return f" vs {s.get('baseline')}: mean KLD vs baseline {q.get('kld_mean', float('nan')):.6f}, {verdict}"
    return ""


def run_recipe(loaded: LoadedRecipe, out_dir: Path | None, force: bool = False) -> RunResult:
    recipe = loaded.recipe
    out = out_dir or recipe.output
    if out is None:
        raise UserError(f"{loaded.path}: no output directory; pass -o OUT_DIR or set 'output:' in the recipe")
    if recipe.eval is not None and recipe.build is None:
        raise UserError(f"{loaded.path}: 'eval' scores an engine; add a 'build:' section (it may be empty)")
    if recipe.speculative is not None and recipe.build is None:
        raise UserError(f"{loaded.path}: 'speculative' speculates for an engine; add a 'build:' section")
    resolved, sha = loaded.resolved(), loaded.sha256
    previous_run = out.is_dir() and is_artifact(out) and read_manifest(out)["stage"] == "run"
    previous = out if previous_run and not force else None
    keys = _stage_keys(recipe)

    written = loaded.written.model_dump(mode="json")  # what recipe_sha256 is of: paths relative to the recipe

    def record(stage: str, tmp: Path) -> StageRecord:
        r = StageRecord(stage, recipe=resolved, recipe_sha256=sha, run_dir=tmp)
        r.details["cache_key"] = keys.get(stage)
        r.details["recipe_as_written"] = written
        return r

    stages: dict[str, dict[str, Any]] = {}
    with atomic_dir(out, force or previous_run, inputs=(recipe.model.path,)) as tmp:
        run = record("run", tmp)
        (tmp / "recipe.yaml").write_text(loaded.to_yaml())
        runners: dict[str, Callable[[StageRecord], _StageResult]] = {
            "convert": lambda r: _convert(recipe, tmp, r),
            "quantize": lambda r: _quantize(recipe, tmp, r),
            "build": lambda r: _build(recipe, tmp, r),
            "draft": lambda r: _draft(recipe, tmp, r),
            "eval": lambda r: _eval(recipe, tmp, out, r),
            "diff": lambda r: baseline_stage(
                recipe.eval, tmp / STAGE_DIRS["build"], tmp / STAGE_DIRS["diff"], r, out.resolve() / STAGE_DIRS["build"]
            ),
        }
        for stage, key in keys.items():
            cached = _reuse(previous, stage, key, tmp)
            if cached is not None:
                console.info(f"{stage}: unchanged (cache key {key[:12]}), reused")
                stages[stage] = cached
                continue
            result = runners[stage](record(stage, tmp)).to_json()
            summary = {k: v for k, v in result.items() if k not in ("outputs", "output_dir", *SUMMARY_LEFT_OUT)}
            stages[stage] = _final_paths(summary, tmp, out.resolve())
            _store_summary(tmp / STAGE_DIRS[stage], stages[stage])
        ran = [s for s, r in stages.items() if not r.get("cached")]
        if not ran:
            console.info("nothing to do: every stage is unchanged")
        run.add_inputs(loaded.path.parent, [loaded.path])
        run.details.update(stages=list(stages), rerun=ran, recipe_file=str(loaded.path))
        if "diff" in stages:
            run.details["baseline_manifest_sha256"] = stages["diff"]["baseline_manifest_sha256"]
        run.warnings += stages["convert"].get("warnings", [])
        manifest = run.write(tmp)
    passed = all(stages.get(stage, {}).get("passed", True) for stage in ("eval", "diff"))
    return RunResult(
        output_dir=str(out.resolve()),
        recipe=str(loaded.path),
        recipe_sha256=sha,
        stages=stages,
        rerun=ran,
        passed=passed,
        outputs=manifest["outputs"],
        warnings=run.warnings,
        wall_time_s=manifest["wall_time_s"],
    )


def _final_paths(value: Any, tmp: Path, out: Path) -> Any:
    """`value` with every path under the temporary run dir named by where it is after the rename."""
    if isinstance(value, dict):
        return {k: _final_paths(v, tmp, out) for k, v in value.items()}
    if isinstance(value, list):
        return [_final_paths(v, tmp, out) for v in value]
    if isinstance(value, str) and (value == str(tmp) or value.startswith(f"{tmp}{os.sep}")):
        return str(out) + value[len(str(tmp)) :]
    return value


def _store_summary(stage_dir: Path, summary: dict[str, Any]) -> None:
    """Keep the stage's summary in its manifest, so that a cached stage reports what it did (the manifest's own
    hashes cover files, not itself)."""
    manifest = read_manifest(stage_dir)
    slim = {k: v for k, v in summary.items() if k not in ("golden", "kld_histogram", "top1_by_position")}
    manifest["details"]["summary"] = slim
    write_manifest(stage_dir, manifest)


def _convert(recipe: Recipe, tmp: Path, record: StageRecord) -> ConvertResult:
    return convert(
        recipe.model.path,
        tmp / STAGE_DIRS["convert"],
        dtype=recipe.model.dtype,
        allow_pickle=recipe.model.allow_pickle,
        tp=recipe.convert.tp,
        pp=recipe.convert.pp,
        workers=recipe.convert.workers,
        record=record,
    )


def _quantize_options(q: QuantizeSection, seed: int) -> QuantizeOptions:
    """A recipe's quantize section (the target's, or the draft's) as quantize's options."""
    return QuantizeOptions(
        q.method,
        q.kv_cache,
        q.group_size,
        q.calib_data,
        q.calib_samples,
        q.calib_seq_len,
        seed,
        tuple(q.exclude),
        q.sq_alpha,
    )


def _quantize(recipe: Recipe, tmp: Path, record: StageRecord) -> QuantizeResult:
    q = recipe.quantize
    assert q is not None
    opts = _quantize_options(q, recipe.seed)
    return quantize_checkpoint(
        tmp / STAGE_DIRS["convert"], tmp / STAGE_DIRS["quantize"], opts, q.eval_data, q.eval_tokens, record=record
    )


def _build(recipe: Recipe, tmp: Path, record: StageRecord) -> BuildResult:
    b = recipe.build
    assert b is not None
    source = tmp / STAGE_DIRS["quantize" if recipe.quantize is not None else "convert"]
    opts = BuildOptions(b.backend, b.max_batch_size, b.max_num_tokens, b.max_seq_len, b.tokens_per_block)
    return build_engine(source, tmp / STAGE_DIRS["build"], opts, record=record)


def _draft(recipe: Recipe, tmp: Path, record: StageRecord) -> BuildResult:
    """The draft engine into `draft/`: convert (its layers), quantize when asked, build; the checkpoints between
    live in a scratch dir removed after (the stage's artifact is the engine; its manifest records how)."""
    assert recipe.speculative is not None
    draft = recipe.speculative.draft_section()
    assert draft is not None
    b = draft_build(recipe, draft)
    model = draft.model or recipe.model.path
    record.details["draft"] = {
        "model": str(model),
        "layers": draft.layers,
        "quantize": draft.quantize.model_dump(mode="json") if draft.quantize is not None else None,
    }
    # the model the draft comes from, as an input beside the scratch checkpoint build reads (gone after the stage)
    record.add_inputs(model, [p for p in sorted(model.iterdir()) if p.suffix in (".json", ".safetensors")])
    with tempfile.TemporaryDirectory(prefix=".draft-", dir=tmp) as scratch:
        work = Path(scratch)
        m = recipe.model
        try:
            convert(model, work / "checkpoint", dtype=m.dtype, allow_pickle=m.allow_pickle, layers=draft.layers)
        except UserError as e:  # convert's words name its flag: say which recipe key set it
            raise UserError(f"speculative.draft: {e}") from e
        source = work / "checkpoint"
        if draft.quantize is not None:
            q = draft.quantize
            quantize_checkpoint(
                source, work / "quantized", _quantize_options(q, recipe.seed), q.eval_data, q.eval_tokens
            )
            source = work / "quantized"
        opts_b = BuildOptions(b.backend, b.max_batch_size, b.max_num_tokens, b.max_seq_len, b.tokens_per_block)
        return build_engine(source, tmp / STAGE_DIRS["draft"], opts_b, record=record)


def _speculation(recipe: Recipe, tmp: Path) -> dict[str, Any]:
    """run_eval's speculation for the recipe's `speculative:` section: the runtime's SpecConfig and, for a draft,
    this run's `draft/` engine (eval's SpecOptions)."""
    s = recipe.speculative
    if s is None:
        return {}
    from toolchain.evaluate.engine_eval import SpecOptions

    config = SpecConfig(s.method, s.num_speculative_tokens, s.prompt_lookup_min, s.prompt_lookup_max)
    return {"speculation": SpecOptions(config, tmp / STAGE_DIRS["draft"] if s.method == "draft" else None)}


def _eval(recipe: Recipe, tmp: Path, out: Path, record: StageRecord) -> EvalResult:
    e = recipe.eval
    assert e is not None
    gates = {k: v for k, v in e.gates.model_dump().items() if v is not None and k not in DIFF_GATES}
    speculation = _speculation(recipe, tmp)
    return run_eval(
        tmp / STAGE_DIRS["build"],
        tmp / STAGE_DIRS["eval"],
        recipe.model.path,
        e.data,
        e.max_tokens,
        e.golden,
        gates,
        record=record,
        engine_label=out.resolve() / STAGE_DIRS["build"],
        **speculation,
    )
