"""The speculative-decoding options every command spells the same (`generate`, `bench`, `serve`; `eval` and `diff`
reuse them): `--ngram [--ngram-min N --ngram-max N]` or `--draft ENGINE_DIR`, and `--num-speculative-tokens K`;
`spec_config` turns them into a `SpecConfig` (refusing contradictions in one line) and `open_draft` opens a draft
engine and checks it against the target (runtime/draft.py `check_draft`: same tokenizer, tokens_per_block, limits).

Names and defaults: the n-gram match lengths are vLLM's `prompt_lookup_min` / `prompt_lookup_max`
(vllm/v1/spec_decode/ngram_proposer.py; vLLM defaults both to 5, "arbitrarily chosen"); trtbuild's defaults 2 / 4
and k = 4 are the issue-30 lead's, from the acceptance measured on stories260K (docs/serving.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from toolchain.errors import UserError

if TYPE_CHECKING:
    from toolchain.engine.api import Engine
    from toolchain.runtime.speculative import SpecConfig

DEFAULT_NGRAM_MIN = 2
DEFAULT_NGRAM_MAX = 4
DEFAULT_SPEC_TOKENS = 4
PANEL = "Speculative decoding"

NgramOpt = Annotated[
    bool,
    typer.Option(
        "--ngram",
        help="Speculate with n-gram prompt lookup (no draft model): the tokens that followed the latest n-gram's "
        "earlier occurrence in the request's own prompt and output are verified by the engine in one call. Greedy "
        "output is unchanged; text that repeats its context (code edits, RAG, summaries) gains the most.",
        rich_help_panel=PANEL,
    ),
]
NgramMinOpt = Annotated[
    int | None,
    typer.Option(
        "--ngram-min",
        min=1,
        help=f"With --ngram: the shortest suffix matched (vLLM's prompt_lookup_min; default {DEFAULT_NGRAM_MIN}).",
        rich_help_panel=PANEL,
    ),
]
NgramMaxOpt = Annotated[
    int | None,
    typer.Option(
        "--ngram-max",
        min=1,
        help=f"With --ngram: the longest suffix matched, tried first (vLLM's prompt_lookup_max; default "
        f"{DEFAULT_NGRAM_MAX}).",
        rich_help_panel=PANEL,
    ),
]
DraftOpt = Annotated[
    Path | None,
    typer.Option(
        "--draft",
        help="Speculate with a draft engine (an engine dir from `trtbuild build`, e.g. of `convert --layers`): it "
        "proposes tokens, the engine verifies them. It must share the engine's tokenizer (same vocabulary and "
        "special ids), tokens_per_block, and have limits at least the engine's; it is refused otherwise.",
        rich_help_panel=PANEL,
    ),
]
SpecTokensOpt = Annotated[
    int | None,
    typer.Option(
        "--num-speculative-tokens",
        min=1,
        help=f"With --ngram or --draft: tokens drafted per step at most (k; default {DEFAULT_SPEC_TOKENS}). Each "
        "step emits 1 to k+1 tokens.",
        rich_help_panel=PANEL,
    ),
]


def spec_config(
    ngram: bool, ngram_min: int | None, ngram_max: int | None, draft: Path | None, num_speculative_tokens: int | None
) -> SpecConfig | None:
    """The speculation the options ask for, or None; contradictions refused in one line naming the options."""
    from toolchain.runtime.speculative import SpecConfig  # numpy: not at the CLI's import

    if ngram and draft is not None:
        raise UserError(f"--ngram and --draft {draft}: choose one proposer (n-gram lookup or a draft engine)")
    if not ngram and (ngram_min is not None or ngram_max is not None):
        given = "--ngram-min" if ngram_min is not None else "--ngram-max"
        raise UserError(f"{given} sets the n-gram proposer's match length: add --ngram")
    if not ngram and draft is None:
        if num_speculative_tokens is not None:
            raise UserError(
                f"--num-speculative-tokens {num_speculative_tokens} needs a proposer: add --ngram or --draft DIR"
            )
        return None
    low = ngram_min if ngram_min is not None else min(DEFAULT_NGRAM_MIN, ngram_max or DEFAULT_NGRAM_MIN)
    high = ngram_max if ngram_max is not None else max(DEFAULT_NGRAM_MAX, low)
    if low > high:
        raise UserError(f"--ngram-min {low} > --ngram-max {high}: need min <= max")
    k = num_speculative_tokens if num_speculative_tokens is not None else DEFAULT_SPEC_TOKENS
    return SpecConfig("ngram" if ngram else "draft", k, low, high)


def open_draft(target: Engine, draft_dir: Path) -> Engine:
    """The draft engine at `draft_dir`, checked against `target` (closed again when refused)."""
    from toolchain.engine.api import close_engine, open_engine
    from toolchain.runtime.draft import check_draft

    if not draft_dir.is_dir():
        raise UserError(f"--draft {draft_dir}: no such engine directory (build one with `trtbuild build`)")
    draft = open_engine(draft_dir)
    try:
        check_draft(target, draft)
    except BaseException:
        close_engine(draft)
        raise
    return draft


def speculation_from_options(
    target: Engine,
    ngram: bool,
    ngram_min: int | None,
    ngram_max: int | None,
    draft: Path | None,
    num_speculative_tokens: int | None,
) -> tuple[SpecConfig | None, Engine | None]:
    """The speculation config and, for --draft, the opened and checked draft engine (the caller closes it)."""
    config = spec_config(ngram, ngram_min, ngram_max, draft, num_speculative_tokens)
    if config is None or draft is None:
        return config, None
    return config, open_draft(target, draft)
