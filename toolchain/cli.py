"""The `trtbuild` command line: thin wrappers that parse options, call a stage, and print its result.

Exit codes: 0 ok, 1 user error (one line on stderr), 2 usage error. TRTBUILD_DEBUG=1 shows tracebacks.
Results go to stdout (`--json` for machines); logs and progress go to stderr.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated, Any

import typer
import typer.core

# typer >= 0.29 vendors click as typer._click: its exceptions are not click's (hence the pin in pyproject.toml).
from typer._click.exceptions import ClickException, UsageError

from toolchain import __version__, console
from toolchain import serve as serving  # the server's defaults (constants only; the server loads on use)
from toolchain.engine.backends import AUTO, TENSORRT
from toolchain.engine.backends import CHOICES as BACKEND_CHOICES
from toolchain.errors import UserError
from toolchain.quantize import FORMATS as QUANTIZE_FORMATS
from toolchain.quantize.methods import (
    DEFAULT_GROUP_SIZE,
    GROUP_SIZE_CHOICES,
    KV_CACHE_NAMES,
    METHOD_NAMES,
    METHODS_HELP,
)
from toolchain.speculation_cli import (
    DraftOpt,
    NgramMaxOpt,
    NgramMinOpt,
    NgramOpt,
    SpecTokensOpt,
    spec_config,
    speculation_from_options,
)

if TYPE_CHECKING:
    from toolchain.runtime.speculative import SpecStats

if TYPE_CHECKING:
    from toolchain.evaluate.engine_eval import SpecOptions


class _PlainErrors(typer.core.TyperGroup):
    """Usage errors in at most three plain lines on stderr (what, usage, where to read more), not a box."""

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        windows_expand_args: bool = True,
        **extra: Any,
    ) -> Any:
        own = (args, prog_name, complete_var)
        if not standalone_mode:
            return super().main(*own, standalone_mode=False, windows_expand_args=windows_expand_args, **extra)
        try:
            code = super().main(*own, standalone_mode=False, windows_expand_args=windows_expand_args, **extra)
        except UsageError as e:
            sys.stderr.write(_usage_error_lines(e))
            sys.exit(e.exit_code)
        except ClickException as e:
            sys.stderr.write(f"error: {e.format_message()}\n")
            sys.exit(e.exit_code)
        except typer.Abort:
            sys.stderr.write("aborted\n")
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


def _usage_error_lines(e: UsageError) -> str:
    # typer validates enum choices through pydantic, whose messages start "Value error, ".
    message = " ".join(e.format_message().replace("Value error, ", "").split())
    errors = getattr(e.__cause__, "errors", None)  # typer's parsing failed in pydantic: name the value given
    if callable(errors) and errors() and repr(errors()[0].get("input")) not in message:
        message += f" (got {errors()[0].get('input')!r})"
    if e.ctx is None:
        return f"error: {message}\n"
    command = e.ctx.command_path
    usage = " ".join(e.ctx.get_usage().split())
    return f"error: {message}\n{usage[0].lower()}{usage[1:]}\nsee: {command} --help\n"


app = typer.Typer(
    cls=_PlainErrors,
    name="trtbuild",
    help="Build quantized TensorRT-LLM engines from Hugging Face checkpoints, with provenance and a quality gate.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)
recipe_app = typer.Typer(help="Recipe tools: schema for editors and CI validation.", no_args_is_help=True)
app.add_typer(recipe_app, name="recipe")


class Dtype(str, Enum):
    auto = "auto"
    float16 = "float16"
    bfloat16 = "bfloat16"
    float32 = "float32"


# Shared options, declared once.
OutputOpt = Annotated[Path, typer.Option("--output", "-o", help="Output directory (written atomically).")]
ForceOpt = Annotated[bool, typer.Option("--force", help="Replace an existing trtbuild output directory.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")]


def _sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # unwinds like Ctrl-C, so partial outputs are removed


@contextmanager
def _handled() -> Iterator[None]:
    try:
        yield
    except UserError as e:
        if os.environ.get("TRTBUILD_DEBUG"):
            raise
        console.err.print(f"error: {e}", style="red", markup=False, soft_wrap=True)
        raise typer.Exit(e.exit_code) from None
    except KeyboardInterrupt:
        if os.environ.get("TRTBUILD_DEBUG"):
            raise
        console.err.print("interrupted: no output was left behind", style="red")
        raise typer.Exit(130) from None


def _emit(result: dict[str, Any], as_json: bool, lines: list[str]) -> None:
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        typer.echo("\n".join(lines))


def _version(value: bool) -> None:
    if value:
        typer.echo(f"trtbuild {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    signal.signal(signal.SIGTERM, _sigterm)


@app.command(epilog="Example: `trtbuild convert ./Llama-3.2-1B -o ./ckpt --dtype bfloat16 --tp 2`")
def convert(
    model_dir: Annotated[Path, typer.Argument(help="Hugging Face model dir (config.json + *.safetensors).")],
    output: OutputOpt,
    dtype: Annotated[Dtype, typer.Option(help="Weight dtype; auto keeps the checkpoint's.")] = Dtype.auto,
    force: ForceOpt = False,
    allow_pickle: Annotated[
        bool,
        typer.Option("--allow-pickle", help="Accept pickle weights (*.bin), loaded with weights_only=True."),
    ] = False,
    tp: Annotated[int, typer.Option("--tp", min=1, help="Tensor-parallel size (heads split over N GPUs).")] = 1,
    pp: Annotated[int, typer.Option("--pp", min=1, help="Pipeline-parallel size (layers split in M stages).")] = 1,
    moe_ep: Annotated[
        int,
        typer.Option(
            "--moe-ep",
            min=1,
            help="Expert-parallel size: a MoE layer's experts split in N groups of each tp group "
            "(divides --tp; the rest, tp / N, splits each expert's width).",
        ),
    ] = 1,
    workers: Annotated[
        int,
        typer.Option(
            "--workers",
            min=1,
            max=64,
            help="Threads preparing tensors ahead; the tensors in flight stay within the largest one.",
        ),
    ] = 2,
    dequantize: Annotated[
        bool,
        typer.Option(
            "--dequantize",
            help="Pre-quantized input (ModelOpt, compressed-tensors, GPTQ, AWQ, block FP8): write float weights "
            "(each linear dequantized; activations and KV cache unquantized) instead of reading its quantization.",
        ),
    ] = False,
    layers: Annotated[
        str | None,
        typer.Option(
            "--layers",
            help="Keep only these decoder layers, renumbered 0..n-1 (comma-separated, increasing, e.g. 0,1,2,4): a "
            "stand-in draft model for speculative decoding (--draft). tp = pp = 1, float checkpoints only.",
        ),
    ] = None,
    json_out: JsonOpt = False,
) -> None:
    """Convert a Hugging Face checkpoint into a TensorRT-LLM checkpoint (config.json + rank{N}.safetensors)."""
    from toolchain.checkpoint.convert import convert as run_convert

    with _handled():
        r = run_convert(
            model_dir,
            output,
            dtype=dtype.value,
            force=force,
            allow_pickle=allow_pickle,
            tp=tp,
            pp=pp,
            workers=workers,
            moe_ep=moe_ep,
            dequantize=dequantize,
            layers=_layer_list(layers) if layers is not None else None,
        )
    _emit(r.to_json(), json_out, r.lines())


def _layer_list(text: str) -> list[int]:
    """`--layers 0,1,2,4` as integers (their order and range are convert's to check, naming the value)."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise UserError(f"--layers {text!r}: expected comma-separated layer numbers, e.g. --layers 0,1,2,4") from None


# the quantization registry's names (toolchain/quantize/methods/__init__.py: no torch at CLI start-up)
def _one_of(values: tuple[int, ...]) -> str:
    """ "32, 64 or 128": a help text's list of choices."""
    *head, last = map(str, values)
    return f"{', '.join(head)} or {last}" if head else last


Method = Enum("Method", {name: name for name in METHOD_NAMES}, type=str)  # type: ignore[misc]
KvCache = Enum("KvCache", {name: name for name in KV_CACHE_NAMES}, type=str)  # type: ignore[misc]
QuantFormat = Enum("QuantFormat", {name: name for name in QUANTIZE_FORMATS}, type=str)  # type: ignore[misc]


@app.command(
    epilog="Example: `trtbuild quantize ./ckpt -o ./ckpt-fp8 --method fp8 --kv-cache fp8 "
    "--calib-data ../shared/data/wikitext-2/valid.txt --eval-data ../shared/data/wikitext-2/test.txt`"
)
def quantize(
    checkpoint: Annotated[Path, typer.Argument(help="A converted (tp=1) checkpoint directory.")],
    output: OutputOpt,
    method: Annotated[
        Method,
        typer.Option(help=f"{METHODS_HELP}."),
    ],
    kv_cache: Annotated[KvCache, typer.Option("--kv-cache", help="KV cache quantization.")] = KvCache("none"),
    group_size: Annotated[
        int, typer.Option("--group-size", help=f"w4a16 group size: {_one_of(GROUP_SIZE_CHOICES)}.")
    ] = (DEFAULT_GROUP_SIZE),
    calib_data: Annotated[
        Path | None,
        typer.Option("--calib-data", help="Calibration text (.txt or .jsonl {'text'}); awq, sq, fp8 and KV cache."),
    ] = None,
    calib_samples: Annotated[int, typer.Option("--calib-samples", min=1, help="Calibration windows.")] = 64,
    calib_seq_len: Annotated[int, typer.Option("--calib-seq-len", min=2, help="Tokens per window.")] = 256,
    seed: Annotated[int, typer.Option(min=0, help="Seed choosing the calibration windows.")] = 0,
    exclude: Annotated[
        list[str] | None, typer.Option("--exclude", help="Module glob left unquantized (repeatable); default lm_head.")
    ] = None,
    sq_alpha: Annotated[
        str,
        typer.Option(
            "--sq-alpha", help="w8a8_sq migration strength α (0: none, 1: all), or 'auto': searched per layer."
        ),
    ] = "0.5",
    eval_data: Annotated[
        Path | None, typer.Option("--eval-data", help="Text to measure the quality cost on (KLD, PPL ratio, top-1).")
    ] = None,
    eval_tokens: Annotated[int, typer.Option("--eval-tokens", min=2, help="Tokens of --eval-data to score.")] = 50_000,
    out_format: Annotated[
        QuantFormat,
        typer.Option(
            "--format",
            help="trtllm: our TensorRT-LLM checkpoint (build reads it); hf: ModelOpt's unified Hugging Face "
            "checkpoint (vLLM, SGLang, TensorRT-LLM's PyTorch backend; fp8, w4a16_awq, w8a16, nvfp4, w4a8_awq).",
        ),
    ] = QuantFormat("trtllm"),
    force: ForceOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Quantize a checkpoint (weights; FP8 activations and the KV cache from calibration) and report the cost."""
    from toolchain.quantize.stage import QuantizeOptions, parse_sq_alpha, quantize_checkpoint

    with _handled():
        opts = QuantizeOptions(
            method.value,
            kv_cache.value,
            group_size,
            calib_data,
            calib_samples,
            calib_seq_len,
            seed,
            tuple(exclude) if exclude else ("lm_head",),
            parse_sq_alpha(sq_alpha),
            out_format.value,
        )
        r = quantize_checkpoint(checkpoint, output, opts, eval_data, eval_tokens, force)
    _emit(r.to_json(), json_out, r.lines())


Backend = Enum("Backend", {name: name for name in BACKEND_CHOICES}, type=str)  # type: ignore[misc]


@app.command(
    epilog="Example: `trtbuild build ./ckpt-fp8 -o ./engine --max-batch-size 32 --max-seq-len 4096` "
    "(auto: TensorRT where it and a GPU are present, else the CPU engine, said on stderr and in the manifest)"
)
def build(
    checkpoint: Annotated[Path, typer.Argument(help="A converted or quantized (tp=1) checkpoint directory.")],
    output: OutputOpt,
    backend: Annotated[
        Backend, typer.Option(help="tensorrt: a TensorRT plan (needs TensorRT + GPU); onnxruntime: the CPU engine.")
    ] = Backend[AUTO],
    max_batch_size: Annotated[int, typer.Option("--max-batch-size", min=1, help="Sequences per call.")] = 16,
    max_num_tokens: Annotated[
        int, typer.Option("--max-num-tokens", min=1, help="Tokens per call (prefill chunks + decodes).")
    ] = 2048,
    max_seq_len: Annotated[
        int, typer.Option("--max-seq-len", min=0, help="Longest sequence; 0: the model's max positions.")
    ] = 0,
    tokens_per_block: Annotated[
        int,
        typer.Option(
            "--tokens-per-block",
            help=f"KV cache block size in tokens (TensorRT: {_one_of(TENSORRT.tokens_per_block)}).",
        ),
    ] = 16,
    tokenizer: Annotated[
        Path | None,
        typer.Option("--tokenizer", help="Copy the tokenizer from this HF model dir (a ModelOpt checkpoint has none)."),
    ] = None,
    force: ForceOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Build an engine: the ONNX engine graph with our plugin ops and explicit quantization, and its TensorRT plan."""
    from toolchain.engine.build import BuildOptions, build_engine

    with _handled():
        opts = BuildOptions(backend.value, max_batch_size, max_num_tokens, max_seq_len, tokens_per_block)
        r = build_engine(checkpoint, output, opts, force, tokenizer=tokenizer)
    _emit(r.to_json(), json_out, r.lines())


def _parse_gates(items: list[str]) -> dict[str, float]:
    gates = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            gates[name.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            raise UserError(f"--gate {item!r}: expected NAME=NUMBER, e.g. kld_mean_max=0.01")
    return gates


def _speculation(
    ngram: bool, ngram_min: int | None, ngram_max: int | None, k: int | None, draft: Path | None
) -> SpecOptions | None:
    """--ngram / --draft and their settings as eval's and diff's speculation; None when neither is given."""
    from toolchain.evaluate.engine_eval import SpecOptions

    config = spec_config(ngram, ngram_min, ngram_max, draft, k)
    return SpecOptions(config, draft) if config is not None else None


@app.command(
    "eval",
    epilog="Example: `trtbuild eval ./engine --reference ./hf-model --data ../shared/data/wikitext-2/test.txt "
    "--golden prompts.jsonl --gate kld_mean_max=0.01 --gate top1_min=0.95` (exit 3 when a gate fails)",
)
def eval_(
    engine_dir: Annotated[Path, typer.Argument(help="An engine directory from `trtbuild build`.")],
    reference: Annotated[Path, typer.Option("--reference", help="The original Hugging Face model dir.")],
    data: Annotated[Path, typer.Option("--data", help="Evaluation text (.txt or .jsonl {'text'}).")],
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Report dir; default: beside the engine (or its run dir).")
    ] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=2, help="Tokens of --data to score.")] = 50_000,
    golden: Annotated[
        Path | None, typer.Option("--golden", help='JSONL of {"prompt": ..., "max_new_tokens": N}: greedy replay.')
    ] = None,
    gate: Annotated[
        list[str] | None,
        typer.Option(
            "--gate",
            metavar="NAME=LIMIT",
            help="kld_mean_max, top1_min, ppl_ratio_max, golden_exact_min, spec_equal_min, acceptance_rate_min "
            "(repeatable); a failure exits 3.",
        ),
    ] = None,
    backend: Annotated[
        Backend | None, typer.Option(help="Run through this backend instead of the engine's own.")
    ] = None,
    ngram: NgramOpt = False,
    ngram_min: NgramMinOpt = None,
    ngram_max: NgramMaxOpt = None,
    num_speculative_tokens: SpecTokensOpt = None,
    draft: DraftOpt = None,
    force: ForceOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Score an engine against the original model (PPL ratio, KLD, top-1, Δp, golden prompts) and apply gates."""
    from toolchain.engine.api import trusted_spec
    from toolchain.engine.build import require_tokenizer
    from toolchain.evaluate.engine_eval import run_eval
    from toolchain.pipeline import default_report_dir

    with _handled():
        gates = _parse_gates(gate or [])
        speculation = _speculation(ngram, ngram_min, ngram_max, num_speculative_tokens, draft)
        trusted_spec(engine_dir)  # the tokenizer is one of the engine's files: they are checked first (exit 4)
        require_tokenizer(engine_dir)
        out = output or default_report_dir(engine_dir)
        r = run_eval(
            engine_dir, out, reference, data, max_tokens, golden, gates, backend.value if backend else None, force,
            speculation=speculation,
        )  # fmt: skip
    _emit(r.to_json(plots=False), json_out, r.lines())
    if not r.passed:
        console.err.print("quality regression: a gate failed (exit 3)", markup=False)
        raise typer.Exit(3)


@app.command(epilog="Example: `trtbuild inspect ./ckpt --json`")
def inspect(
    directory: Annotated[Path, typer.Argument(help="A checkpoint (later: engine) or run output directory.")],
    json_out: JsonOpt = False,
) -> None:
    """Show what an artifact is: architecture, dtype, mapping, quantization, and its manifest's summary."""
    from toolchain.inspect import describe, describe_lines

    with _handled():
        info = describe(directory)
    _emit(info, json_out, describe_lines(info))


@app.command(epilog="Example: `trtbuild verify ./ckpt` (exit 1 lists every mismatch)")
def verify(
    directory: Annotated[Path, typer.Argument(help="An artifact directory with a manifest.json.")],
    inputs: Annotated[bool, typer.Option("--inputs", help="Also re-hash the input files the manifest lists.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Re-hash every file listed in the manifest; exit 1 naming each mismatch."""
    from toolchain.manifest import verify as run_verify

    with _handled():
        problems = run_verify(directory, check_inputs=inputs)
    _emit(
        {"ok": not problems, "problems": problems},
        json_out,
        [f"{directory}: {'ok' if not problems else f'{len(problems)} problem(s)'}"],
    )
    for problem in problems:
        console.err.print(f"mismatch: {problem}", markup=False)
    if problems:
        raise typer.Exit(1)


@app.command(epilog="Example: `trtbuild run recipes/demo.yaml -o out/demo --set model.dtype=bfloat16`")
def run(
    recipe: Annotated[Path, typer.Argument(help="A YAML recipe (see recipes/ and `trtbuild recipe schema`).")],
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Output directory; default: the recipe's 'output'.")
    ] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            help="Override a recipe key: dotted.key=value (repeatable; YAML values; paths relative to the recipe).",
            metavar="KEY=VALUE",
        ),
    ] = None,
    force: ForceOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Run a recipe's stages (convert, quantize, build, eval) into one output directory; unchanged stages are
    reused. Exit 3 when an eval gate fails."""
    from toolchain.pipeline import run_recipe
    from toolchain.recipe import load_recipe

    with _handled():
        loaded = load_recipe(recipe, set_ or [])
        r = run_recipe(loaded, output, force=force)
    _emit(r.to_json(), json_out, r.lines())
    if not r.passed:
        console.err.print("quality regression: a gate failed (exit 3)", markup=False)
        raise typer.Exit(3)


@app.command(
    epilog="Example: `trtbuild generate demo/out/engine --prompt 'Once upon a time' --max-new-tokens 40 --stream`"
)
def generate(
    engine_dir: Annotated[Path, typer.Argument(help="An engine directory from `trtbuild build`.")],
    prompt: Annotated[str, typer.Option("--prompt", help="Text to continue.")],
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1, help="Tokens to generate at most.")] = 32,
    temperature: Annotated[float, typer.Option(min=0.0, help="0: greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p", min=0.0, max=1.0, help="Nucleus sampling mass.")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", min=0, help="Keep the k likeliest tokens (0: all).")] = 0,
    seed: Annotated[int, typer.Option(min=0, help="Sampling seed.")] = 0,
    stop: Annotated[list[str] | None, typer.Option("--stop", help="Stop string (repeatable).")] = None,
    presence_penalty: Annotated[
        float, typer.Option("--presence-penalty", min=-2.0, max=2.0, help="OpenAI's: minus this per generated token.")
    ] = 0.0,
    frequency_penalty: Annotated[
        float, typer.Option("--frequency-penalty", min=-2.0, max=2.0, help="OpenAI's: minus this times its count.")
    ] = 0.0,
    repetition_penalty: Annotated[
        float, typer.Option("--repetition-penalty", min=0.0, help="HF's, over prompt and output (1: off).")
    ] = 1.0,
    min_p: Annotated[float, typer.Option("--min-p", min=0.0, max=1.0, help="Drop tokens below min_p x the top.")] = 0.0,
    logit_bias: Annotated[
        list[str] | None, typer.Option("--logit-bias", help="ID=BIAS added to that token's logit (repeatable).")
    ] = None,
    stream: Annotated[bool, typer.Option("--stream", help="Print tokens as they are generated.")] = False,
    ngram: NgramOpt = False,
    ngram_min: NgramMinOpt = None,
    ngram_max: NgramMaxOpt = None,
    draft: DraftOpt = None,
    num_speculative_tokens: SpecTokensOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Generate text with an engine through the in-flight batching runtime (the server's sampling parameters).
    With --ngram or --draft the runtime speculates: greedy output is the same tokens, only faster where drafts are
    accepted."""
    from toolchain.engine.api import close_engine, load_tokenizer, open_engine
    from toolchain.runtime.llm_engine import LLMEngine
    from toolchain.runtime.request import FinishReason, SamplingParams

    with _handled():
        if not 0 < top_p <= 1:
            raise UserError(f"--top-p {top_p}: must be in (0, 1]")
        if repetition_penalty <= 0:
            raise UserError(f"--repetition-penalty {repetition_penalty}: must be > 0 (1: off)")
        spec_config(ngram, ngram_min, ngram_max, draft, num_speculative_tokens)  # refused before any engine opens
        engine = open_engine(engine_dir)  # first: the tokenizer is one of the files it checks
        draft_engine = None
        try:
            speculation, draft_engine = speculation_from_options(
                engine, ngram, ngram_min, ngram_max, draft, num_speculative_tokens
            )
            tok = load_tokenizer(engine_dir)
            eos = (tok.eos_token_id,) if tok.eos_token_id is not None else ()
            params = SamplingParams(
                max_new_tokens,
                temperature,
                top_k,
                top_p,
                seed,
                eos,
                tuple(stop or ()),
                presence_penalty=presence_penalty,
                frequency_penalty=frequency_penalty,
                repetition_penalty=repetition_penalty,
                logit_bias=_logit_bias(logit_bias or []),
                min_p=min_p,
            )
            with LLMEngine(engine, tok, speculation=speculation, draft_engine=draft_engine) as llm:
                events = llm.submit(prompt, params)
                ids, pieces = [], []
                for event in events:
                    ids += [event.token] if event.token is not None else []
                    pieces.append(event.text)
                    if stream and not json_out and event.text:
                        typer.echo(event.text, nl=False)
                if event.finish_reason == FinishReason.ERROR:
                    raise UserError(f"generation failed: {event.error}")
                spec = llm.runtime.spec_stats
        finally:
            if draft_engine is not None:
                close_engine(draft_engine)
            close_engine(engine)  # a multi-rank engine's ranks stop here
    if stream and not json_out:
        typer.echo("")
        return
    text = "".join(pieces)
    result = {"prompt": prompt, "text": text, "tokens": ids, "finish_reason": event.finish_reason}
    if speculation is not None:  # on stderr: stdout is the same as without speculation
        console.info(_spec_line(speculation.method, spec))
    _emit(result, json_out, [text])


def _spec_line(method: str, stats: SpecStats) -> str:
    rate, mal = stats.acceptance_rate, stats.mean_accepted_length
    return (
        f"speculation ({method}): {stats.drafts} drafts, {stats.accepted}/{stats.draft_tokens} drafted tokens "
        f"accepted ({'-' if rate is None else f'{100 * rate:.1f} %'}), mean accepted length "
        f"{'-' if mal is None else f'{mal:.2f}'}"
    )


def _logit_bias(pairs: list[str]) -> tuple[tuple[int, float], ...]:
    out = []
    for pair in pairs:
        token, _, bias = pair.partition("=")
        try:
            out.append((int(token), float(bias)))
        except ValueError:
            raise UserError(f"--logit-bias {pair!r}: expected ID=BIAS, e.g. 2=-100") from None
        if out[-1][0] < 0 or not -100 <= out[-1][1] <= 100:
            raise UserError(f"--logit-bias {pair!r}: the id must be >= 0 and the bias in [-100, 100]")
    return tuple(out)


@app.command(
    "bench",
    epilog="Example: `trtbuild bench demo/out/engine --trace ../shared/data/traces/AzureLLMInferenceTrace_conv.csv "
    "--max-requests 200 --rate-scale 2 --plot kv.svg`",
)
def bench_(
    engine_dir: Annotated[Path, typer.Argument(help="An engine directory from `trtbuild build`.")],
    trace: Annotated[Path, typer.Option("--trace", help="Azure .csv or Mooncake .jsonl request trace.")],
    rate_scale: Annotated[float, typer.Option("--rate-scale", min=0.001, help="Arrival rate multiplier.")] = 1.0,
    max_requests: Annotated[int, typer.Option("--max-requests", min=1, help="First N requests of the trace.")] = 100,
    policy: Annotated[
        str, typer.Option(help="guaranteed_no_evict or max_utilization (preempts by recompute).")
    ] = "max_utilization",
    kv_blocks: Annotated[int, typer.Option("--kv-blocks", min=0, help="KV pool blocks; 0: the build's.")] = 0,
    static: Annotated[
        bool,
        typer.Option(
            "--static",
            help="Baseline: batches of max_batch_size requests, each run to completion before the next is admitted "
            "(request-level batching on the same runtime, no padding) instead of in-flight batching.",
        ),
    ] = False,
    prefix_sharing: Annotated[
        bool, typer.Option("--prefix-sharing/--no-prefix-sharing", help="Reuse cached KV blocks of shared prefixes.")
    ] = True,
    max_gap_s: Annotated[
        float,
        typer.Option(
            "--max-gap-s",
            min=0.001,
            help="A gap between two arrivals (after --rate-scale) longer than this is shortened to it, with a line "
            "saying so, so a trace's quiet hours do not make the benchmark wait in real time.",
        ),
    ] = 60.0,
    allow_failures: Annotated[
        bool,
        typer.Option("--allow-failures", help="Exit 0 even when requests fail (they are listed with the reason)."),
    ] = False,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write KV-cache utilization over time (SVG).")] = None,
    ngram: NgramOpt = False,
    ngram_min: NgramMinOpt = None,
    ngram_max: NgramMaxOpt = None,
    draft: DraftOpt = None,
    num_speculative_tokens: SpecTokensOpt = None,
    prompts: Annotated[
        Path | None,
        typer.Option(
            "--prompts",
            help='With --ngram/--draft: JSONL of {"prompt": ...} or {"text": ...} put, cycled, on the trace\'s '
            "arrivals and output lengths. A trace's own prompts are random ids: what speculation gains on them is "
            "not what it gains on text.",
            rich_help_panel="Speculative decoding",
        ),
    ] = None,
    rounds: Annotated[
        int,
        typer.Option(
            "--rounds",
            min=1,
            help="With --ngram/--draft: interleaved rounds of the plain and the speculative replay (medians).",
            rich_help_panel="Speculative decoding",
        ),
    ] = 1,
    json_out: JsonOpt = False,
) -> None:
    """Replay a request trace with its real arrival times; report throughput, TTFT, TPOT, queue time, preemptions,
    prefix-cache hits. Exits 1 when any request fails, unless --allow-failures. With --ngram or --draft: the trace
    replayed without and with speculation, both results, their ratio, acceptance, mean accepted length and a
    projected GPU speedup (labelled as such: a CPU run cannot measure it)."""
    from toolchain.engine.api import close_engine, load_tokenizer, open_engine
    from toolchain.runtime.replay import (
        compare_speculation,
        read_prompts,
        replay,
        speculation_table,
        table,
        utilization_svg,
        with_prompts,
    )
    from toolchain.runtime.scheduler import POLICIES
    from toolchain.runtime.traces import load_trace

    with _handled():
        if policy not in POLICIES:
            raise UserError(f"--policy {policy!r}: choose {' or '.join(POLICIES)}")
        config = spec_config(ngram, ngram_min, ngram_max, draft, num_speculative_tokens)
        if config is None and (prompts is not None or rounds != 1):
            raise UserError("--prompts and --rounds compare speculation against plain decoding: add --ngram or --draft")
        if config is not None and (static or plot):
            raise UserError("--static and --plot are for a plain replay: drop them with --ngram/--draft")
        texts = read_prompts(prompts) if prompts is not None else None
        engine = open_engine(engine_dir)
        draft_engine = None
        try:
            limits = engine.spec.limits
            requests, scale = load_trace(
                trace, limits.max_seq_len, engine.vocab_size, max_requests, rate_scale, max_gap_s=max_gap_s
            )
            console.info(
                f"replaying {len(requests)} requests of {trace.name} (lengths x {scale:.4f}, rate x {rate_scale})"
            )
            if config is not None:
                config, draft_engine = speculation_from_options(
                    engine, ngram, ngram_min, ngram_max, draft, num_speculative_tokens
                )
                assert config is not None
                source = "the trace's (random ids)"
                if texts is not None:
                    tok = load_tokenizer(engine_dir)
                    ids = [list(tok.encode(t)) for t in texts]
                    requests = with_prompts(requests, ids, limits.max_seq_len)
                    source = f"{prompts} ({len(texts)} texts, cycled)"
                r = compare_speculation(
                    engine,
                    requests,
                    config,
                    draft_engine,
                    rounds,
                    policy=policy,
                    num_blocks=kv_blocks or None,
                    prefix_sharing=prefix_sharing,
                )
                r.update(prompts=source, draft=str(draft) if draft is not None else None)
            else:
                r = replay(engine, requests, policy, kv_blocks or None, static, prefix_sharing)
        finally:
            if draft_engine is not None:
                close_engine(draft_engine)
            close_engine(engine)  # a multi-rank engine's ranks stop here
        r["settings"].update(max_requests=max_requests, rate_scale=rate_scale, max_gap_s=max_gap_s, seed=0)
        cut = [q.gap_cut_s for q in requests if q.gap_cut_s > 0]
        r.update(trace=str(trace), length_scale=scale, gaps_cut=len(cut), gap_seconds_cut=sum(cut))
        if plot:
            utilization_svg(r["kv_utilization"], plot, f"KV blocks in use, {trace.name}")
    if config is not None:
        _emit(r, json_out, speculation_table(r))
        lost = [(side, r[side]) for side in ("plain", "speculative") if r[side]["not_completed"]]
        if lost and not allow_failures:
            side, run = lost[0]
            reason = next(iter(run["failure_reasons"]), "unknown")
            raise UserError(
                f"{side} replay: {run['not_completed']} of {run['requests']} requests did not complete (first "
                f"reason: {reason}); fix the engine or trace, or pass --allow-failures to accept"
            )
        return
    _emit(r if json_out else {k: v for k, v in r.items() if k != "kv_utilization"}, json_out, table(r))
    if r["not_completed"] and not allow_failures:
        reason = next(iter(r["failure_reasons"]), "unknown")
        console.err.print(
            f"error: {r['not_completed']} of {r['requests']} requests did not complete (first reason: {reason}); "
            "fix the engine or trace, or pass --allow-failures to accept",
            style="red",
            markup=False,
            soft_wrap=True,
        )
        raise typer.Exit(1)


@app.command(
    epilog="Example: `trtbuild serve demo/out/engine --port 8000`, then `curl localhost:8000/v1/completions -H "
    '\'Content-Type: application/json\' -d \'{"model": "engine", "prompt": "The build farm", "max_tokens": 16}\'`'
)
def serve(
    engine_dir: Annotated[
        Path, typer.Argument(help="An engine directory from `trtbuild build` (checked against its manifest).")
    ],
    host: Annotated[
        str, typer.Option(help="Address to listen on; beyond loopback only with --api-keys.")
    ] = serving.DEFAULT_HOST,
    port: Annotated[int, typer.Option(min=0, max=65535, help="TCP port.")] = serving.DEFAULT_PORT,
    api_keys: Annotated[
        Path | None,
        typer.Option("--api-keys", help="Keys file: one `id:sha256hex(key)[:rpm=N,tpm=N]` line per key."),
    ] = None,
    max_queue: Annotated[
        int, typer.Option("--max-queue", min=1, help="Waiting requests beyond which new ones get 429.")
    ] = serving.DEFAULT_MAX_QUEUE,
    request_timeout: Annotated[
        float, typer.Option("--request-timeout", min=0.001, help="Seconds before a request is aborted (408).")
    ] = serving.DEFAULT_REQUEST_TIMEOUT_S,
    drain_timeout: Annotated[
        float, typer.Option("--drain-timeout", min=0.0, help="On SIGTERM, seconds to let requests in flight finish.")
    ] = serving.DEFAULT_DRAIN_TIMEOUT_S,
    served_model_name: Annotated[
        str | None,
        typer.Option("--served-model-name", help="The model id clients send; default the engine dir's name."),
    ] = None,
    log_requests: Annotated[
        bool,
        typer.Option("--log-requests", help="Put prompt and output text in the request log (off: ids and counts)."),
    ] = False,
    tool_call_parser: Annotated[
        str | None,
        typer.Option(
            "--tool-call-parser",
            help="How tool calls are read from the model's text: hermes (Qwen3, Hermes) or llama3_json (Llama 3.x); "
            "default: detected from the chat template, printed at start-up.",
        ),
    ] = None,
    ngram: NgramOpt = False,
    ngram_min: NgramMinOpt = None,
    ngram_max: NgramMaxOpt = None,
    draft: DraftOpt = None,
    num_speculative_tokens: SpecTokensOpt = None,
) -> None:
    """Serve an engine over HTTP with OpenAI's API (/v1/completions, /v1/chat/completions, /v1/models), vLLM's
    /tokenize, /detokenize and /tokenizer_info, /version, health and readiness probes, Prometheus metrics under vLLM's
    names, API keys, per-key rate limits and graceful drain. With --ngram or --draft the server speculates (greedy
    output unchanged) and exposes vLLM's vllm:spec_decode_* counters."""
    from toolchain.serve.app import ServeOptions
    from toolchain.serve.server import serve as run_server

    with _handled():
        options = ServeOptions(
            host,
            port,
            api_keys,
            max_queue,
            request_timeout,
            drain_timeout,
            served_model_name,
            log_requests,
            tool_call_parser=tool_call_parser,
            speculation=spec_config(ngram, ngram_min, ngram_max, draft, num_speculative_tokens),
            draft=draft,
        )
        run_server(engine_dir, options)


@app.command(
    "diff",
    epilog="Example: `trtbuild diff released/ candidate/ --data ../shared/data/wikitext-2/test.txt --golden "
    "prompts.jsonl --trace trace.csv --gate kld_vs_old_max=0.05 --gate throughput_ratio_min=0.9 -o diff-report` "
    "(exit 3 when a gate fails; exit 1 for bad input, the same directory twice, or --data/--golden on two "
    "different models)",
)
def diff_(
    old: Annotated[Path, typer.Argument(help="The released engine: an engine dir or a `trtbuild run` dir.")],
    new: Annotated[Path, typer.Argument(help="The candidate engine: an engine dir or a `trtbuild run` dir.")],
    data: Annotated[
        Path | None,
        typer.Option("--data", help="Text both engines score; default the eval data of NEW's (else OLD's) recipe."),
    ] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=2, help="Tokens of --data to score.")] = 4096,
    reference: Annotated[
        Path | None, typer.Option("--reference", help="The original HF model: each engine against it too.")
    ] = None,
    golden: Annotated[
        Path | None, typer.Option("--golden", help='JSONL of {"prompt": ..., "max_new_tokens": N}: greedy outputs.')
    ] = None,
    trace: Annotated[
        Path | None, typer.Option("--trace", help="Azure .csv or Mooncake .jsonl trace both engines replay.")
    ] = None,
    max_requests: Annotated[int, typer.Option("--max-requests", min=1, help="First N requests of the trace.")] = 16,
    rate_scale: Annotated[float, typer.Option("--rate-scale", min=0.001, help="Arrival rate multiplier.")] = 1.0,
    rounds: Annotated[int, typer.Option("--rounds", min=1, help="Interleaved replay rounds per engine.")] = 3,
    gate: Annotated[
        list[str] | None,
        typer.Option(
            "--gate",
            metavar="NAME=LIMIT",
            help="kld_vs_old_max, kld_p99_vs_old_max, top1_vs_old_min, ppl_ratio_vs_old_max, golden_same_min, "
            "throughput_ratio_min, ttft_p90_ratio_max, tpot_p90_ratio_max, new_spec_equal_min, "
            "new_acceptance_rate_min, acceptance_ratio_vs_old_min (repeatable); a failure exits 3.",
        ),
    ] = None,
    ngram: NgramOpt = False,
    ngram_min: NgramMinOpt = None,
    ngram_max: NgramMaxOpt = None,
    num_speculative_tokens: SpecTokensOpt = None,
    draft: DraftOpt = None,
    changes_only: Annotated[
        bool, typer.Option("--changes-only", help="Only what changed, from the manifests (no model run).")
    ] = False,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Report dir (report.json/.md/.html).")] = None,
    force: ForceOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """What changed between two engines (weights, recipe, quantization, limits, backend, versions), what it cost
    in quality (NEW vs OLD: KLD, top-1, PPL; golden prompts) and speed (trace replay), with gates (exit 3)."""
    from toolchain.evaluate.diff import DiffOptions, DiffResult, run_diff

    def show_changes(r: DiffResult) -> None:
        if not json_out:
            typer.echo("\n".join(r.change_lines(old, new)))

    with _handled():
        opts = DiffOptions(
            data, max_tokens, reference, golden, trace, max_requests, rate_scale, rounds,
            tuple(_parse_gates(gate or []).items()), changes_only,
            _speculation(ngram, ngram_min, ngram_max, num_speculative_tokens, draft),
        )  # fmt: skip
        r = run_diff(old, new, opts, output, force, on_changes=show_changes)
    _emit(r.to_json(plots=False), json_out, r.lines())
    if r.quality_refused:
        console.err.print(f"error: quality comparison refused: {r.quality_refused}", markup=False)
        raise typer.Exit(1)
    if not r.passed:
        console.err.print("release regression: a diff gate failed (exit 3)", markup=False)
        raise typer.Exit(3)


plugins_app = typer.Typer(help="The plugin kernels (Triton, toolchain/plugins/kernels).", no_args_is_help=True)
app.add_typer(plugins_app, name="plugins")


@plugins_app.command(
    "compile",
    epilog="Example: `trtbuild plugins compile --arch sm_90 --json` (no GPU needed: the triton wheel ships ptxas). "
    "Cold, every SM: 1 to 2 minutes on 2 cores; cached afterwards (docs/kernels.md).",
)
def plugins_compile(
    arch: Annotated[
        list[str] | None,
        typer.Option("--arch", help="Target SM, repeatable or comma-separated (sm_80 ... sm_120); default every one."),
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="Cache and output dir; default ~/.cache/trtbuild/plugins.")
    ] = None,
    strict: Annotated[bool, typer.Option("--strict", help="Exit 1 on any register spill (CI).")] = False,
    jobs: Annotated[int | None, typer.Option("--jobs", "-j", min=1, help="Compile processes; default: CPUs.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Compile the Triton kernels ahead of time, for every variant of the matrix (activation x KV pool dtype on a
    standard layer, plus the head sizes, block sizes, windows and rotary styles that take other code paths, and the
    MoE experts' two GEMM stages on a Qwen3-30B-A3B-like and a small layer), to the PTX TensorRT loads and a cubin
    per SM; report each kernel's registers, spills, shared memory and threads.

    The PTX is Triton's with its two hidden scratch parameters removed (TensorRT passes only inputs, int32 extra
    arguments and outputs) and the PTX ISA version set per SM (8.0 up to sm_90, 8.6 sm_100, 8.7 sm_120: loadable by
    any driver that runs the GPU); the cubin and resources are ptxas' on that PTX. `--json` adds per kernel its
    spill stores and loads, stack, PTX parameter list and ISA, and the .ptx / .cubin paths under --out. Results are
    cached there by a hash of the kernel sources, Triton version, variant and SM: an unchanged kernel is not
    recompiled, and the engine build reads the same cache for the variant it needs.
    """
    from toolchain.plugins.compile import ARCHS, cache_dir, compile_variants, summary

    with _handled():
        archs = tuple(a.strip() for item in (arch or list(ARCHS)) for a in item.split(",") if a.strip())
        out_dir = out or cache_dir()
        results = compile_variants(archs, out_dir, jobs)
        info = summary(results, out_dir)
        if strict and info["spills"]:
            spilling = sorted({f"{k.name} {j.variant} {j.arch}" for j, k in results if k.spills})
            raise UserError(f"{info['spills']} bytes of register spills: {', '.join(spilling)}; see --json")
    lines = [
        f"triton {info['triton']} (ptxas {', '.join(info['ptxas'])}): {info['kernels']} kernels, "
        f"{info['compiled']} compiled ({info['compile_s']} s of compile), the rest cached in {out_dir}",
    ]
    v = max([len("variant"), *(len(j.variant) for j, _ in results)])
    n = max([len("kernel"), *(len(k.name) for _, k in results)])
    lines.append(f"{'SM':<7} {'variant':<{v}} {'kernel':<{n}} {'regs':>4} {'spills':>6} {'shared':>7} {'threads':>7}")
    for j, k in results:
        lines.append(
            f"{j.arch:<7} {j.variant:<{v}} {k.name:<{n}} {k.registers:>4} {k.spills:>6} {k.shared_bytes:>7} "
            f"{k.threads:>7}"
        )
    lines.append(f"spills: {info['spills']} bytes in all")
    _emit(info, json_out, lines)


@recipe_app.command("schema", epilog="Example: `trtbuild recipe schema > recipe.schema.json`")
def recipe_schema() -> None:
    """Print the recipe's JSON Schema (for editors and CI validation)."""
    from toolchain.recipe import schema

    typer.echo(json.dumps(schema(), indent=2))


@app.command(
    "tiny-model",
    epilog="Example: `trtbuild tiny-model demo/tiny-llama --seed 0`; `trtbuild tiny-model demo/tiny-moe --moe`",
)
def tiny_model(
    output: Annotated[Path, typer.Argument(help="Where to write the Hugging Face model dir.")],
    seed: Annotated[int, typer.Option(help="Random seed for the weights.", min=0, max=2**32 - 1)] = 0,
    moe: Annotated[bool, typer.Option("--moe", help="A tiny random Qwen3-MoE (8 experts, top-2) instead.")] = False,
    force: ForceOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Create the embedded default: a small random Llama (HF format, a few MB) made by trtbuild itself."""
    from toolchain.checkpoint.tiny import make_tiny_llama, make_tiny_moe

    with _handled():
        r = (make_tiny_moe if moe else make_tiny_llama)(output, seed=seed, force=force)
    kind = "Qwen3-MoE" if moe else "Llama"
    _emit(
        r,
        json_out,
        [f"wrote tiny {kind} ({r['num_parameters']:,} parameters, seed {seed}) -> {r['output_dir']}"],
    )


def main() -> None:
    app()


if __name__ == "__main__":
    main()
