"""`trtbuild eval`: the quality module's metrics on an ENGINE's logits (through its backend) against the original
Hugging Face model in float32; greedy golden-prompt replay, and with a proposer the same replay speculating
(`spec_golden`, issue 30); gates that turn a regression into exit code 3."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from toolchain import console
from toolchain.atomic import atomic_dir, check_output_dir
from toolchain.engine.api import (
    BUILD_CONFIG,
    MODEL_NAME,
    Engine,
    EngineSpec,
    close_engine,
    load_tokenizer,
    open_trusted,
    rank_dir,
    trusted_spec,
)
from toolchain.engine.contract import Batch
from toolchain.engine.geometry import blocks_for
from toolchain.errors import UserError
from toolchain.evaluate.gates import EVAL, SPEC_NEEDS, GateResult, check, check_limit
from toolchain.evaluate.golden import TokenBytes, compare, read_golden
from toolchain.evaluate.report import write_reports
from toolchain.evaluate.results import EvalResult
from toolchain.manifest import MANIFEST_NAME, StageRecord, environment, read_manifest, sha256_file
from toolchain.quality import QualityReport, collect, kld_histogram, summarize
from toolchain.quantize.methods.registry import by_algo
from toolchain.runtime.llm_engine import LLMEngine
from toolchain.runtime.request import SamplingParams
from toolchain.runtime.speculative import SpecConfig, SpecStats
from toolchain.text import tokenize


class EngineSession:
    """Scores whole sequences through an engine within its build limits: rows packed per call up to max_batch_size
    and max_num_tokens, prefills longer than max_num_tokens chunked. Golden prompts go through the Generation API
    instead, as served requests do."""

    def __init__(self, engine: Engine):
        self.engine, self.limits = engine, engine.spec.limits
        self.tpb = engine.tokens_per_block

    def _blocks(self, length: int) -> int:
        return blocks_for(length, self.tpb)

    def all_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [batch, seq] -> logits [batch, seq, vocab] (float32), each row a sequence of its own."""
        rows, seq = ids.shape
        if seq > self.limits.max_seq_len:
            raise UserError(f"sequences of {seq} tokens exceed the engine's max_seq_len {self.limits.max_seq_len}")
        per_call = max(1, min(self.limits.max_batch_size, self.limits.max_num_tokens // seq))
        chunk = min(seq, self.limits.max_num_tokens)
        out = []
        for start in range(0, rows, per_call):
            group = ids[start : start + per_call].tolist()
            pool = self.engine.new_kv_cache(len(group) * self._blocks(seq))
            tables = [list(range(k * self._blocks(seq), (k + 1) * self._blocks(seq))) for k in range(len(group))]
            pieces = []
            for at in range(0, seq, chunk):  # chunked prefill when a row is longer than one call's budget
                batch = Batch.from_sequences([g[at : at + chunk] for g in group], [at] * len(group), tables, True)
                pieces.append(self.engine.forward(batch, pool).reshape(len(group), -1, self.engine.vocab_size))
            out.append(torch.from_numpy(np.concatenate(pieces, axis=1)))
        return torch.cat(out)

    def greedy(self, prompts: list[list[int]], new_tokens: list[int]) -> list[list[int]]:
        """Greedy continuations through the in-flight batching runtime, all prompts batched together."""
        return self.speculative(prompts, new_tokens)[0]

    def speculative(
        self,
        prompts: list[list[int]],
        new_tokens: list[int],
        speculation: SpecConfig | None = None,
        draft: Engine | None = None,
        temperature: float = 0.0,
    ) -> tuple[list[list[int]], list[SpecStats], SpecStats]:
        """Greedy continuations as `greedy` (or, with a `temperature`, sampled with prompt i's seed i), the runtime
        speculating with `speculation` (and the `draft` engine); each prompt's speculation counters and the whole
        run's."""
        for prompt, n in zip(prompts, new_tokens, strict=True):
            if len(prompt) + n > self.limits.max_seq_len:
                raise UserError(f"prompt + {n} new tokens exceed the engine's max_seq_len {self.limits.max_seq_len}")
        with LLMEngine(self.engine, speculation=speculation, draft_engine=draft) as llm:
            streams = [
                llm.submit(p, SamplingParams(max_new_tokens=n, temperature=temperature, seed=i))
                for i, (p, n) in enumerate(zip(prompts, new_tokens, strict=True))
            ]
            done = [s.result() for s in streams]
            total = llm.runtime.spec_stats
        for c in done:
            if c.error:
                raise UserError(f"golden prompt {c.request_id}: the engine failed: {c.error}")
        per_prompt = [s.request.spec if s.request is not None else SpecStats() for s in streams]
        return [c.token_ids for c in done], per_prompt, total

    def top2(self, context: list[int]) -> dict[str, Any]:
        """The engine's two likeliest next tokens after `context` and their logit margin (a tie is margin ~0)."""
        values, ids = torch.topk(self.all_logits(torch.tensor([context]))[0, -1], 2)
        return {"target_top2": ids.tolist(), "margin": float(values[0] - values[1])}


class Reference:
    """The original Hugging Face model in float32 on CPU."""

    def __init__(self, hf_dir: Path):
        if not (hf_dir / "config.json").is_file():
            raise UserError(f"--reference {hf_dir}: not a Hugging Face model dir (no config.json)")
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # their loading bar is noise here
        self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)  # in eval mode already

    @torch.no_grad()
    def all_logits(self, ids: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.model(ids).logits
        return logits.float()

    @torch.no_grad()
    def greedy(self, prompt: list[int], new_tokens: int) -> list[int]:
        # transformers 5.x renamed past_key_values to cache; accept either
        key = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        out = self.model(torch.tensor([prompt]), use_cache=True)
        generated = [int(out.logits[0, -1].argmax())]
        while len(generated) < new_tokens:
            out = self.model(torch.tensor([[generated[-1]]]), use_cache=True, **{key: out[key]})
            generated.append(int(out.logits[0, -1].argmax()))
        return generated


def check_gates(gates: dict[str, float], metrics: dict[str, float | None]) -> list[GateResult]:
    """A metric this evaluation did not compute is an error, except acceptance: a proposer that drafted nothing
    has no acceptance rate, and fails its gate."""
    missing = "this evaluation did not compute (golden prompts?)"
    return [
        r
        for gate, limit in gates.items()
        for r in check(
            {gate: limit}, metrics, EVAL, None if gate in EVAL and EVAL[gate].needs == SPEC_NEEDS else missing
        )
    ]


@dataclass(frozen=True)
class SpecOptions:
    """What `eval` and `diff` speculate with: the runtime's config and, for draft-target, the draft engine's dir."""

    config: SpecConfig
    draft: Path | None = None

    def check(self) -> None:
        """Before any work: the draft is an engine that is what its manifest says."""
        if self.config.method == "draft":
            if self.draft is None:
                raise UserError("speculative method 'draft' needs the draft engine: pass --draft DIR")
            trusted_spec(self.draft)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "method": self.config.method,
            "num_speculative_tokens": self.config.num_speculative_tokens,
        }
        if self.config.method == "ngram":
            out.update(prompt_lookup_min=self.config.prompt_lookup_min, prompt_lookup_max=self.config.prompt_lookup_max)
        else:
            out["draft"] = str(self.draft.resolve()) if self.draft else None
        return out


SAMPLED_TEMPERATURE = 0.8  # the seeded sampled replay of spec_golden: a temperature that samples, not near-greedy


def spec_golden(
    engine: Engine, prompts: list[list[int]], new_tokens: list[int], plain: list[list[int]], spec: SpecOptions
) -> dict[str, Any]:
    """The golden prompts again, speculating: `spec_equal` (the share token-identical to `plain`, the same engine's
    greedy output without speculation), vLLM's acceptance counters (runtime/speculative.py) over the run and per
    prompt, and where a prompt differs, its first differing token with the target's top-2 margin there (a margin
    near 0 is a numerical tie; the gate does not excuse it)."""
    session = EngineSession(engine)
    draft = open_trusted(trusted_spec(spec.draft)) if spec.config.method == "draft" and spec.draft else None
    sampled_equal = None
    try:
        outs, per_prompt, total = session.speculative(prompts, new_tokens, spec.config, draft)
        if spec.config.method == "ngram":  # seed-identical under sampling by its rule (runtime/rejection.py)
            plain_sampled, _, _ = session.speculative(prompts, new_tokens, None, None, SAMPLED_TEMPERATURE)
            spec_sampled, _, _ = session.speculative(prompts, new_tokens, spec.config, None, SAMPLED_TEMPERATURE)
            sampled_equal = sum(a == b for a, b in zip(plain_sampled, spec_sampled, strict=True)) / len(prompts)
    finally:
        if draft is not None:
            close_engine(draft)
    records = []
    for ids, want, got, stats in zip(prompts, plain, outs, per_prompt, strict=True):
        diverge = next((k for k, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), None)
        if diverge is None and len(want) != len(got):
            diverge = min(len(want), len(got))
        record: dict[str, Any] = {"equal": diverge is None, "first_divergence": diverge, **stats.to_json()}
        if diverge is not None:
            record.update(
                plain_token=want[diverge] if diverge < len(want) else None,
                speculative_token=got[diverge] if diverge < len(got) else None,
                **session.top2(ids + want[:diverge]),
            )
        records.append(record)
    drafts = total.drafts
    return {
        **spec.to_json(),
        "prompts": len(records),
        "spec_equal": sum(r["equal"] for r in records) / len(records),
        **total.to_json(),
        "per_position_rate": [n / drafts for n in total.per_pos] if drafts else [],
        # n-gram: the share of seeded sampled replays identical with and without speculation (1.0 by the rule); a
        # draft sampling from its own q is correctly distributed but not seed-identical: None
        "sampled_equal": sampled_equal,
        "per_prompt": records,
    }


def evaluate_engine(
    engine: Engine,
    engine_dir: Path,
    reference_dir: Path,
    data: Path,
    max_tokens: int,
    golden: Path | None,
    gates: dict[str, float],
    spec: SpecOptions | None = None,
) -> EvalResult:
    session, reference = EngineSession(engine), Reference(reference_dir)
    vocab = reference.model.get_input_embeddings().num_embeddings
    if vocab != engine.spec.vocab_size:  # another model: its logits would be compared index by index with ours
        raise UserError(
            f"--reference {reference_dir}: a vocabulary of {vocab}, the engine's is {engine.spec.vocab_size}; pass "
            "the Hugging Face model this engine was converted from"
        )
    tokens = tokenize(data, engine_dir, max_tokens=max_tokens)
    window = min(256, engine.spec.limits.max_seq_len)
    if tokens.numel() < window:
        raise UserError(f"{data}: {tokens.numel()} tokens, fewer than one evaluation window of {window}")
    console.info(f"scoring the engine on {tokens.numel():,} tokens of {data} in windows of {window}")
    stats = collect(reference.all_logits, session.all_logits, tokens, window)
    report: QualityReport = summarize(stats)
    golden_results: list[dict[str, Any]] = []
    speculative: dict[str, Any] | None = None
    if golden is not None:
        tok = load_tokenizer(engine_dir)
        items, token_bytes = read_golden(golden), TokenBytes(tok)
        prompts = [tok(item.prompt, add_special_tokens=True)["input_ids"] for item in items]
        served = session.greedy(prompts, [item.max_new_tokens for item in items])
        for item, ids, got in zip(items, prompts, served, strict=True):
            want = reference.greedy(ids, item.max_new_tokens)
            golden_results.append(compare(token_bytes, item.prompt, ids, got, want))
        if spec is not None:
            console.info(f"replaying {len(prompts)} golden prompts speculating ({spec.config.method})")
            speculative = spec_golden(engine, prompts, [item.max_new_tokens for item in items], served, spec)
    golden_exact = sum(g["exact"] for g in golden_results) / len(golden_results) if golden_results else None
    metrics: dict[str, float | None] = {**report.to_dict(), "golden_exact": golden_exact}
    if speculative is not None:
        metrics.update(spec_equal=speculative["spec_equal"], acceptance_rate=speculative["acceptance_rate"])
    gate_results = check_gates(gates, metrics)
    return EvalResult(
        engine_dir=str(engine_dir.resolve()),
        reference=str(reference_dir.resolve()),
        data=str(data.resolve()),
        window=window,
        quality=report,
        golden_exact=golden_exact,
        golden_prompts=len(golden_results),
        golden=golden_results,
        gates=gate_results,
        passed=all(g.passed for g in gate_results),
        speculative=speculative,
        kld_histogram=_histogram(stats["kld"].reshape(-1)),
        top1_by_position=stats["top1"].mean(0).tolist(),
    )


def built(spec: EngineSpec) -> dict[str, Any]:
    """What the engine is, from its spec and manifest: method, group size, KV cache dtype, backend, the manifest's
    sha256, which trtbuild built it, and the TensorRT / GPU a plan is tied to."""
    engine_dir = spec.engine_dir
    algo = spec.quantization.get("quant_algo")
    grouped = by_algo(algo, str(engine_dir / BUILD_CONFIG)) if algo else None
    compat = spec.compatibility or {}
    has_manifest = (engine_dir / MANIFEST_NAME).is_file()
    tool = read_manifest(engine_dir).get("toolchain", {}) if has_manifest else {}
    return {
        "method": algo,  # None: unquantized
        "group_size": spec.quantization.get("group_size") if grouped and grouped.grouped else None,
        "kv_cache": spec.kv_cache.dtype,
        "dtype": spec.dtype,
        "backend": spec.backend,
        "engine_manifest_sha256": sha256_file(engine_dir / MANIFEST_NAME) if has_manifest else None,
        "trtbuild_version": tool.get("version"),
        "git_commit": tool.get("git_commit"),
        "git_dirty": tool.get("git_dirty"),
        "tensorrt": compat.get("tensorrt"),
        "gpu": compat.get("gpu"),
        "sm": compat.get("sm"),
        "onnxruntime": spec.onnxruntime,
    }


def evaluated_with(backend: str) -> dict[str, Any]:
    """The backend the logits came from, and the trtbuild, TensorRT and GPU of this machine."""
    env = environment()
    return {
        "backend": backend,
        "trtbuild_version": env["toolchain"]["version"],
        "git_commit": env["toolchain"]["git_commit"],
        "git_dirty": env["toolchain"]["git_dirty"],
        "tensorrt": env["packages"].get("tensorrt"),
        "gpu": env["gpu"]["name"],
    }


def _histogram(kld: torch.Tensor) -> dict[str, list[float]]:
    edges, (counts,) = kld_histogram([kld])
    return {"edges": edges, "counts": counts}


def run_eval(
    engine_dir: Path,
    out_dir: Path,
    reference_dir: Path,
    data: Path,
    max_tokens: int = 50_000,
    golden: Path | None = None,
    gates: dict[str, float] | None = None,
    backend: str | None = None,
    force: bool = False,
    record: StageRecord | None = None,
    engine_label: Path | None = None,
    speculation: SpecOptions | None = None,
) -> EvalResult:
    """Evaluate, then write report.json / .md / .html and a manifest into `out_dir` (atomically).
    `engine_label`: where the engine will live, when it is still being written elsewhere (a recipe run); `speculation`:
    replay the golden prompts speculating too (spec_equal, acceptance)."""

    spec = trusted_spec(engine_dir)  # an engine dir that is what its manifest says, before any work
    for path, what in ((data, "--data"), (golden, "--golden")):
        if path is not None and not path.is_file():
            raise UserError(f"{what} {path}: no such file")
    for gate, limit in (gates or {}).items():  # everything a user can get wrong, before any work
        needs = check_limit(gate, limit, EVAL).needs
        if needs.startswith("--golden") and golden is None:
            raise UserError(f"gate {gate} needs golden prompts: pass --golden PROMPTS.jsonl")
        if needs == SPEC_NEEDS and speculation is None:
            raise UserError(f"gate {gate} needs speculation on the golden prompts: pass --ngram or --draft DIR")
    if speculation is not None:
        if golden is None:
            raise UserError("speculation is measured on the golden prompts: pass --golden PROMPTS.jsonl")
        speculation.check()
    if golden is not None:
        tok = load_tokenizer(engine_dir)
        for item in read_golden(golden):
            if not tok(item.prompt, add_special_tokens=True)["input_ids"]:
                raise UserError(f"{golden}: prompt {item.prompt!r} tokenizes to nothing; give it some text")
    check_output_dir(out_dir, force, inputs=(engine_dir, reference_dir))
    engine = open_trusted(spec, backend)
    try:
        result = evaluate_engine(engine, engine_dir, reference_dir, data, max_tokens, golden, gates or {}, speculation)
    finally:
        close_engine(engine)  # a multi-rank engine's ranks (processes) stop here
    result = replace(result, built=built(spec), evaluated_with=evaluated_with(backend or spec.backend))
    if engine_label is not None:
        result = replace(result, engine_dir=str(engine_label))
    record = record or StageRecord("eval")
    record.details.update(
        quality=result.quality.to_dict(),
        golden_exact=result.golden_exact,
        golden_prompts=result.golden_prompts,
        speculative=_spec_summary(result.speculative),
        gates=[g.to_json() for g in result.gates],
        passed=result.passed,
        built=result.built,
    )
    with atomic_dir(out_dir, force, inputs=(engine_dir, reference_dir)) as tmp:
        graphs = (
            [rank_dir(engine_dir, r) / MODEL_NAME for r in range(spec.world_size)]
            if spec.world_size > 1
            else [engine_dir / MODEL_NAME]
        )  # a multi-rank engine's graphs are its ranks'
        record.add_inputs(engine_dir, [engine_dir / BUILD_CONFIG, *graphs])
        for text in (data, golden):
            if text is not None:
                record.add_inputs(text.parent, [text])
        if speculation is not None and speculation.draft is not None and speculation.config.method == "draft":
            record.add_inputs(speculation.draft, [speculation.draft / BUILD_CONFIG])
        write_reports(result.to_json(), tmp)
        manifest = record.write(tmp)
    return replace(result, report_dir=str(out_dir.resolve()), outputs=manifest["outputs"])


def _spec_summary(speculative: dict[str, Any] | None) -> dict[str, Any] | None:
    """The manifest's record of the speculative replay: the run's figures, not each prompt's."""
    if speculative is None:
        return None
    return {k: v for k, v in speculative.items() if k != "per_prompt"}
