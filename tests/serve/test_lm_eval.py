"""lm-evaluation-harness against `trtbuild serve` (issue 29): lm-eval 0.4.13's `local-completions` model, in its own
venv (`make setup-peers`), with `tokenizer_backend=remote` (it tokenizes through the server's /tokenizer_info,
/tokenize and /detokenize) and offline, runs two local tasks (tests/serve/lm_eval/) against a stories260K engine
served in this process: a multiple-choice task (loglikelihood requests: echo + logprobs) and a generate_until task.

The gate is equality with the engine, not accuracy (stories260K scores near chance): every per-doc loglikelihood
lm-eval logs (`--log_samples`) equals the engine's own score of the same tokens (`EngineSession.all_logits`, summed
over the continuation) within the float32 bound of tests/runtime/logprob_bound.py times the tokens summed; `acc`
equals the accuracy those engine scores give, exactly; every generation equals the engine's greedy tokens' text cut
at the first newline, and `exact_match` the share of them equal to the targets, exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.runtime.logprob_bound import tolerance
from tests.serve.helpers import MODEL, Running, running
from toolchain.checkpoint.convert import convert
from toolchain.engine.api import load_tokenizer, open_engine
from toolchain.engine.build import BuildOptions, build_engine
from toolchain.evaluate.engine_eval import EngineSession
from toolchain.runtime.logprobs import log_softmax

VENV = Path(os.environ.get("TRTBUILD_PEERS", Path.home() / ".cache" / "trtbuild-peers")) / "venvs" / "lm-eval"
TASKS = Path(__file__).parent / "lm_eval"
MAX_SEQ_LEN = 128


@pytest.fixture(scope="module")
def lm_eval_python() -> Path:
    python = VENV / "bin" / "python"
    if not (VENV / ".installed").is_file():
        pytest.skip(f"lm-eval venv absent: {VENV} (make setup-peers creates it)")
    return python


@pytest.fixture(scope="module")
def stories_engine(stories: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("lm-eval")
    convert(stories, tmp / "ckpt")
    opts = BuildOptions(backend="onnxruntime", max_seq_len=MAX_SEQ_LEN, max_batch_size=4, max_num_tokens=256)
    build_engine(tmp / "ckpt", tmp / "engine", opts)
    return tmp / "engine"


@pytest.fixture(scope="module")
def stories_server(stories_engine: Path) -> Iterator[Running]:
    with running(stories_engine) as r:
        yield r


def run_lm_eval(python: Path, server: Running, out: Path) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """lm-eval's results and its logged samples per task."""
    model_args = (
        f"model={MODEL},base_url={server.url}/v1/completions,tokenizer_backend=remote,tokenized_requests=True,"
        f"num_concurrent=1,max_retries=1,max_length={MAX_SEQ_LEN}"
    )
    cmd = [str(python), "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args]
    cmd += ["--tasks", "trtbuild_mc,trtbuild_gen", "--include_path", str(TASKS), "--batch_size", "1"]
    cmd += ["--output_path", str(out), "--log_samples"]
    env = {
        **{k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")},
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(out / "hf"),  # the json datasets' cache: none shared with other runs
        "OPENAI_API_KEY": "unused",
    }
    done = subprocess.run(cmd, cwd=TASKS, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    samples = {
        task: [json.loads(line) for line in next(out.rglob(f"samples_{task}_*.jsonl")).read_text().splitlines()]
        for task in ("trtbuild_mc", "trtbuild_gen")
    }
    return results, samples


def encode(tokenizer: Any, text: str) -> list[int]:
    """What lm-eval's remote tokenizer gets from /tokenize: no special tokens."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def continuation_score(session: EngineSession, tokenizer: Any, context: str, continuation: str) -> tuple[float, float]:
    """The engine's loglikelihood of `continuation` after `context`, split into tokens as lm-eval does
    (lm_eval/api/model.py `TemplateLM._encode_pair`: trailing spaces of the context move to the continuation; the
    continuation's tokens are the whole text's after the context's), and the bound on its float32 difference."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = encode(tokenizer, context + continuation)
    start = len(encode(tokenizer, context))
    logits = session.all_logits(torch.tensor([whole]))[0]
    ref = np.stack([log_softmax(row) for row in logits.numpy()])
    score = float(sum(ref[p - 1, whole[p]] for p in range(start, len(whole))))
    return score, (len(whole) - start) * tolerance(logits)


def greedy_text(session: EngineSession, tokenizer: Any, context: str, max_tokens: int, eos: int) -> str:
    """The engine's greedy continuation as the server's text (decode(prompt + out) minus decode(prompt)), ended at
    eos and cut at the first newline (the task's `until`)."""
    prompt = encode(tokenizer, context)
    out = session.greedy([prompt], [max_tokens])[0]
    out = out[: out.index(eos)] if eos in out else out
    head, full = tokenizer.decode(prompt), tokenizer.decode(prompt + out)
    assert full.startswith(head)
    return str(full[len(head) :].split("\n")[0])


@pytest.mark.slow
def test_lm_eval_scores_equal_the_engines_own(
    lm_eval_python: Path, stories_engine: Path, stories_server: Running, tmp_path: Path
) -> None:
    started = time.monotonic()
    results, samples = run_lm_eval(lm_eval_python, stories_server, tmp_path / "out")
    elapsed = time.monotonic() - started
    tokenizer = load_tokenizer(stories_engine)
    session = EngineSession(open_engine(stories_engine))

    mc = samples["trtbuild_mc"]
    assert len(mc) == 20
    correct = []
    for doc in sorted(mc, key=lambda d: d["doc_id"]):
        ours = []
        for k, args in enumerate(doc["arguments"].values()):
            theirs = float(doc["filtered_resps"][k][0])
            score, bound = continuation_score(session, tokenizer, args["arg_0"], args["arg_1"])
            assert abs(theirs - score) <= bound, (doc["doc_id"], k, theirs, score, bound)
            ours.append((score, bound))
        best = int(np.argmax([s for s, _ in ours]))
        runner_up = max((s for i, (s, _) in enumerate(ours) if i != best), default=-np.inf)
        assert ours[best][0] - runner_up > 2 * ours[best][1]  # the pick is not within float noise
        correct.append(float(best == doc["doc"]["label"]))
        assert doc["acc"] == correct[-1]
    assert results["results"]["trtbuild_mc"]["acc,none"] == pytest.approx(np.mean(correct), abs=0)

    gen = samples["trtbuild_gen"]
    assert len(gen) == 10
    eos = int(tokenizer.eos_token_id)
    matches = []
    for doc in sorted(gen, key=lambda d: d["doc_id"]):
        expected = greedy_text(session, tokenizer, doc["arguments"]["gen_args_0"]["arg_0"], 8, eos)
        assert doc["filtered_resps"][0] == expected, doc["doc_id"]
        matches.append(float(expected == doc["target"]))
    assert results["results"]["trtbuild_gen"]["exact_match,none"] == pytest.approx(np.mean(matches), abs=0)
    print(
        f"lm-eval on stories260K: acc {np.mean(correct):.2f} over {len(mc)} docs, exact_match {np.mean(matches):.2f}"
        f" over {len(gen)} docs; lm-eval run {elapsed:.1f} s",
        file=sys.stderr,
    )
