"""The quality-regression report in three forms: report.json (everything), report.md (for a CI summary or a
pull request), report.html (self-contained: inline SVG plots, no script, no network)."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path
from typing import Any

from toolchain.evaluate.golden import LEGEND, readable
from toolchain.quality import QualityReport


def write_reports(result: dict[str, Any], out_dir: Path) -> list[Path]:
    return write_report_files(out_dir, result, markdown(result), page(result))


def write_report_files(out_dir: Path, result: dict[str, Any], md: str, html_page: str) -> list[Path]:
    """report.json, report.md and report.html (eval's and diff's reports alike)."""
    paths = [out_dir / "report.json", out_dir / "report.md", out_dir / "report.html"]
    paths[0].write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    paths[1].write_text(md, encoding="utf-8")
    paths[2].write_text(html_page, encoding="utf-8")
    return paths


def _verdict(result: dict[str, Any]) -> str:
    if not result["gates"]:
        return "no gates set"
    return "PASS" if result["passed"] else "REGRESSION"


def summary_lines(s: dict[str, Any]) -> list[str]:
    """The terminal summary of `eval` and `run`: metrics, then the golden exact-match rate beside the gates.
    `s` is a result, a recipe run's eval summary or an eval manifest's details."""
    lines = QualityReport(**s["quality"]).lines()
    if s.get("golden_exact") is not None:
        count = s.get("golden_prompts") or len(s.get("golden", []))
        lines.append(f"golden exact       {100 * s['golden_exact']:.1f} % of {count} prompts")
    if s.get("speculative"):
        lines += spec_lines(s["speculative"])
    lines += [
        f"gate {g['gate']:<17} {_value(g)} vs {g['limit']:g}: {'pass' if g['pass'] else 'FAIL'}" for g in s["gates"]
    ]
    return lines


def _value(g: dict[str, Any]) -> str:
    return "-" if g["value"] is None else format(g["value"], ".6g")  # None: not computed (nothing drafted)


def spec_how(sp: dict[str, Any]) -> str:
    """How a speculative replay speculated, in words."""
    k = sp["num_speculative_tokens"]
    if sp["method"] == "ngram":
        return f"n-gram [{sp['prompt_lookup_min']}, {sp['prompt_lookup_max']}], k {k}"
    return f"draft {sp.get('draft')}, k {k}"


def spec_lines(sp: dict[str, Any], label: str = "speculative") -> list[str]:
    """A speculative golden replay (engine_eval.spec_golden) in a few terminal lines."""
    lines = [
        f"{label} ({spec_how(sp)}): {100 * sp['spec_equal']:.1f} % of {sp['prompts']} golden prompts "
        "token-identical to plain greedy"
    ]
    if sp["acceptance_rate"] is None:
        lines.append("  nothing drafted: no acceptance rate")
    else:
        per = " ".join(f"{r:.2f}" for r in sp["per_position_rate"])
        lines.append(
            f"  acceptance {sp['acceptance_rate']:.3f} ({sp['accepted_tokens']} of {sp['draft_tokens']} drafted), "
            f"mean accepted length {sp['mean_accepted_length']:.3f}, per position {per}"
        )
    for i, r in enumerate(sp.get("per_prompt", [])):
        if not r["equal"]:
            lines.append(
                f"  prompt {i} differs at token {r['first_divergence']}: plain {r['plain_token']} vs speculative "
                f"{r['speculative_token']} (target top-2 {r['target_top2']}, margin {r['margin']:.3g})"
            )
    return lines


def spec_markdown(sp: dict[str, Any]) -> list[str]:
    """The report.md section of a speculative golden replay."""
    lines = ["", "## Speculative decoding", "", f"Golden prompts replayed greedily speculating ({spec_how(sp)}).", ""]
    lines += ["| metric | value |", "|---|---:|"]
    lines.append(f"| token-identical to plain greedy | {100 * sp['spec_equal']:.1f} % of {sp['prompts']} |")
    rate, mal = sp["acceptance_rate"], sp["mean_accepted_length"]
    lines.append(f"| acceptance rate | {'-' if rate is None else format(rate, '.4f')} |")
    lines.append(f"| mean accepted length | {'-' if mal is None else format(mal, '.4f')} |")
    lines.append(f"| drafts / drafted / accepted | {sp['drafts']} / {sp['draft_tokens']} / {sp['accepted_tokens']} |")
    lines.append(f"| per position | {' '.join(format(r, '.3f') for r in sp['per_position_rate']) or '-'} |")
    differ = [(i, r) for i, r in enumerate(sp.get("per_prompt", [])) if not r["equal"]]
    for i, r in differ:
        lines.append(
            f"- prompt {i}: first difference at token {r['first_divergence']}, plain {r['plain_token']} vs "
            f"speculative {r['speculative_token']}; the target's top-2 there {r['target_top2']}, margin "
            f"{r['margin']:.3g}"
        )
    return lines


def built_rows(built: dict[str, Any] | None) -> list[tuple[str, str]]:
    """What was built, as (label, value) rows: the report's header and `inspect`."""
    if not built:
        return []
    method = built["method"] or "unquantized"
    if built.get("group_size"):
        method += f", group size {built['group_size']}"
    backend = built["backend"]
    if built.get("tensorrt") or built.get("gpu"):
        backend += (
            f" (TensorRT {built.get('tensorrt') or '-'}, {built.get('gpu') or 'no GPU'}, SM {built.get('sm') or '-'})"
        )
    elif built.get("onnxruntime"):
        backend += f" (onnxruntime {built['onnxruntime']}, CPU)"
    tool = built.get("trtbuild_version") or "unknown"
    if built.get("git_commit"):
        tool += f", commit {built['git_commit'][:12]}{' (uncommitted changes)' if built.get('git_dirty') else ''}"
    return [
        ("method", method),
        ("KV cache", built["kv_cache"]),
        ("dtype", built["dtype"]),
        ("backend", backend),
        ("engine manifest sha256", built.get("engine_manifest_sha256") or "none (the engine has no manifest)"),
        ("built by trtbuild", tool),
    ]


def _evaluated_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    ev = result.get("evaluated_with")
    if not ev:
        return []
    tool = ev["trtbuild_version"] + (f", commit {ev['git_commit'][:12]}" if ev.get("git_commit") else "")
    where = f"{ev['backend']} backend" + (f", TensorRT {ev['tensorrt']}" if ev.get("tensorrt") else "")
    return [("evaluated with", f"{where}, GPU {ev.get('gpu') or 'none'}, trtbuild {tool}")]


def _md_code(text: str) -> str:
    """`text` as a markdown code span whatever backticks it holds."""
    if not text:
        return "(empty)"
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _md_ids(ids: list[int], mark: int | None) -> str:
    return " ".join(f"**{t}**" if k == mark else str(t) for k, t in enumerate(ids))


def markdown(result: dict[str, Any]) -> str:
    q = QualityReport(**result["quality"])
    lines = [
        f"# Quality report: {_verdict(result)}",
        "",
    ]
    rows = built_rows(result.get("built")) + _evaluated_rows(result)
    if rows:
        lines += ["| built | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows), ""]
    lines += [
        f"Engine `{result['engine_dir']}` against `{result['reference']}` (transformers, float32) on "
        f"`{result['data']}`: {q.tokens:,} tokens in {q.windows} windows of {result['window']}.",
        "",
        "| metric | value |",
        "|---|---:|",
        f"| PPL (engine) | {q.ppl_variant:.4f} |",
        f"| PPL (reference) | {q.ppl_reference:.4f} |",
        f"| PPL ratio | {q.ppl_ratio:.5f} |",
        f"| mean KLD | {q.kld_mean:.6f} |",
        f"| KLD p50 / p90 / p99 | {q.kld_p50:.6f} / {q.kld_p90:.6f} / {q.kld_p99:.6f} |",
        f"| KLD max | {q.kld_max:.6f} |",
        f"| same top-1 | {100 * q.same_top1:.2f} % |",
        f"| mean / RMS Δp | {100 * q.dp_mean:+.3f} % / {100 * q.dp_rms:.3f} % |",
    ]
    if result["golden_exact"] is not None:
        lines.append(f"| golden exact match | {100 * result['golden_exact']:.1f} % ({len(result['golden'])} prompts) |")
    if result["gates"]:
        lines += ["", "| gate | limit | value | result |", "|---|---:|---:|---|"]
        lines += [
            f"| {g['gate']} | {g['limit']:g} | {_value(g)} | {'pass' if g['pass'] else '**FAIL**'} |"
            for g in result["gates"]
        ]
    if result.get("speculative"):
        lines += spec_markdown(result["speculative"])
    diverged = [g for g in result["golden"] if not g["exact"]]
    if diverged:
        lines += ["", "## Golden prompts that diverged", ""]
        legend = "; ".join(f"{_md_code(escape)} {meaning}" for escape, meaning in LEGEND)
        lines += [f"Text rendered from the tokens' bytes: {legend}. The first differing token id is in bold.", ""]
        for g in diverged:
            lines += _md_divergence(g)
    return "\n".join(lines) + "\n"


def _md_divergence(g: dict[str, Any]) -> list[str]:
    k = g["first_divergence"]
    head = f"- prompt {_md_code(readable(g['prompt'].encode()))}: first divergence at token {k} of {g['tokens']}"
    if "engine_ids" not in g:  # a report.json from before token ids were kept
        return [head, f"  - engine: {_md_code(g['engine'])}", f"  - reference: {_md_code(g['reference'])}"]
    return [
        f"{head}, engine {g['engine_ids'][k]} {_md_code(g['engine_tokens'][k])} vs reference "
        f"{g['reference_ids'][k]} {_md_code(g['reference_tokens'][k])}",
        f"  - engine: {_md_code(g['engine'])}",
        f"  - engine ids: {_md_ids(g['engine_ids'], k)}",
        f"  - reference: {_md_code(g['reference'])}",
        f"  - reference ids: {_md_ids(g['reference_ids'], k)}",
    ]


def _svg_bars(counts: list[float], labels: list[str], title: str, width: int = 640, height: int = 220) -> str:
    top = max(max(counts), 1.0)
    pad, bw = 40, (width - 60) / max(len(counts), 1)
    bars = []
    for k, c in enumerate(counts):
        h = (height - 2 * pad) * c / top
        x, y = pad + k * bw, height - pad - h
        bars.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{bw - 2:.1f}" height="{h:.1f}" fill="#4a7bd0"/>')
    ticks = "".join(
        f'<text x="{pad + k * bw:.1f}" y="{height - pad + 14}" font-size="9">{html.escape(labels[k])}</text>'
        for k in range(0, len(labels), max(1, len(labels) // 6))
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" aria-label="{title}">'
        f'<text x="{pad}" y="18" font-size="13" font-weight="bold">{html.escape(title)}</text>'
        f'<text x="4" y="{pad}" font-size="9">{int(top)}</text>'
        f'<text x="4" y="{height - pad}" font-size="9">0</text>'
        f'<line x1="{pad}" y1="{height - pad}" x2="{width - 20}" y2="{height - pad}" stroke="#333"/>'
        + "".join(bars)
        + ticks
        + "</svg>"
    )


def _svg_line(values: list[float], title: str, width: int = 640, height: int = 220) -> str:
    """A fraction by position, on a y-axis from 0 % to 100 % (a zoomed axis makes 99 % look like a cliff)."""
    pad = 40
    step = (width - 60) / max(len(values) - 1, 1)
    points = " ".join(f"{pad + k * step:.1f},{height - pad - (height - 2 * pad) * v:.1f}" for k, v in enumerate(values))
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" aria-label="{title}">'
        f'<text x="{pad}" y="18" font-size="13" font-weight="bold">{html.escape(title)}</text>'
        f'<text x="4" y="{pad}" font-size="9">100%</text>'
        f'<text x="4" y="{height - pad}" font-size="9">0%</text>'
        f'<line x1="{pad}" y1="{height - pad}" x2="{width - 20}" y2="{height - pad}" stroke="#333"/>'
        f'<polyline points="{points}" fill="none" stroke="#d0574a" stroke-width="1.5"/>'
        f'<text x="{pad}" y="{height - pad + 14}" font-size="9">position 1</text>'
        f'<text x="{width - 90}" y="{height - pad + 14}" font-size="9">position {len(values)}</text>'
        "</svg>"
    )


def page(result: dict[str, Any]) -> str:
    q = QualityReport(**result["quality"])
    verdict = _verdict(result)
    color = {"PASS": "#1d7a3a", "REGRESSION": "#b3261e"}.get(verdict, "#555")
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>" for k, v in _metric_rows(q, result))
    gates = "".join(
        f"<tr><td>{g['gate']}</td><td>{g['limit']:g}</td><td>{_value(g)}</td>"
        f"<td style='color:{'#1d7a3a' if g['pass'] else '#b3261e'}'>{'pass' if g['pass'] else 'FAIL'}</td></tr>"
        for g in result["gates"]
    )
    hist = result["kld_histogram"]
    labels = [f"{e:.1e}" for e in hist["edges"][:-1]]
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>trtbuild quality report: {verdict}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 1000px; }}
table {{ border-collapse: collapse; margin: 1em 0; }} td, th {{ border: 1px solid #ccc; padding: 4px 10px; }}
table.num td:nth-child(n+2) {{ text-align: right; font-variant-numeric: tabular-nums; }}
.verdict {{ color: white; background: {color}; padding: 2px 10px; border-radius: 4px; }}
code, .tok {{ font-family: ui-monospace, monospace; }} .diff {{ background: #fde2e1; }}
.ids {{ font-size: 80%; color: #555; }} mark {{ background: #f7c948; }} table.built th {{ text-align: left; }}
</style></head><body>
<h1>Quality report <span class="verdict">{verdict}</span></h1>
{_built_table(result)}
<p>Engine <code>{html.escape(result["engine_dir"])}</code> against <code>{html.escape(result["reference"])}</code>
(transformers, float32) on <code>{html.escape(result["data"])}</code>: {q.tokens:,} tokens in {q.windows} windows of
{result["window"]}.</p>
<table class="num"><tr><th>metric</th><th>value</th></tr>{rows}</table>
{_table("Gates", ["gate", "limit", "value", "result"], gates, "num")}
<h2>Plots</h2>
{_svg_bars(hist["counts"], labels, "KLD per token (log10 bins)")}
{_svg_line(result["top1_by_position"], "Same top-1 by position in the window")}
{_golden_section(result)}
</body></html>
"""


def _table(title: str, header: list[str], rows: str, css: str = "") -> str:
    if not rows:
        return ""
    head = "".join(f"<th>{h}</th>" for h in header)
    return f"<h2>{title}</h2><table class='{css}'><tr>{head}</tr>{rows}</table>"


def _metric_rows(q: QualityReport, result: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [
        ("PPL (engine)", f"{q.ppl_variant:.4f}"),
        ("PPL (reference)", f"{q.ppl_reference:.4f}"),
        ("PPL ratio", f"{q.ppl_ratio:.5f}"),
        ("mean KLD", f"{q.kld_mean:.6f}"),
        ("KLD p50 / p90 / p99", f"{q.kld_p50:.6f} / {q.kld_p90:.6f} / {q.kld_p99:.6f}"),
        ("KLD max", f"{q.kld_max:.6f}"),
        ("same top-1", f"{100 * q.same_top1:.2f} %"),
        ("mean / RMS Δp", f"{100 * q.dp_mean:+.3f} % / {100 * q.dp_rms:.3f} %"),
    ]
    if result["golden_exact"] is not None:
        rows.append(("golden exact match", f"{100 * result['golden_exact']:.1f} %"))
    sp = result.get("speculative")
    if sp:
        rate = sp["acceptance_rate"]
        rows.append((f"speculative ({spec_how(sp)}): token-identical", f"{100 * sp['spec_equal']:.1f} %"))
        rows.append(("speculative acceptance rate", "-" if rate is None else f"{rate:.4f}"))
    return rows


def _built_table(result: dict[str, Any]) -> str:
    rows = built_rows(result.get("built")) + _evaluated_rows(result)
    cells = "".join(f"<tr><th>{html.escape(k)}</th><td><code>{html.escape(v)}</code></td></tr>" for k, v in rows)
    return f"<table class='built'>{cells}</table>" if cells else ""


def _golden_section(result: dict[str, Any]) -> str:
    rows = "".join(_golden_row(g) for g in result["golden"])
    if not rows:
        return ""
    legend = "; ".join(f"<code>{html.escape(escape)}</code> {html.escape(meaning)}" for escape, meaning in LEGEND)
    note = (
        f"<p>Text rendered from the tokens' bytes: {legend}. Token ids below each continuation: the first that "
        "differs is marked; hover an id for its token.</p>"
    )
    return _table("Golden prompts", ["prompt", "engine", "reference", "first divergence"], rows) + note


def _html_continuation(g: dict[str, Any], side: str) -> str:
    text = f"<div>{html.escape(g[side])}</div>"
    if f"{side}_ids" not in g:  # a report.json from before token ids were kept
        return text
    ids = " ".join(
        f"<{'mark' if k == g['first_divergence'] else 'span'} title='{html.escape(piece, quote=True)}'>{t}"
        f"</{'mark' if k == g['first_divergence'] else 'span'}>"
        for k, (t, piece) in enumerate(zip(g[f"{side}_ids"], g[f"{side}_tokens"], strict=True))
    )
    return f"{text}<div class='ids'>{ids}</div>"


def _golden_row(g: dict[str, Any]) -> str:
    mark = "" if g["exact"] else " class='diff'"
    k = g["first_divergence"]
    where = "—" if k is None else f"token {k} of {g['tokens']}"
    if k is not None and "engine_ids" in g:
        where += f": {g['engine_ids'][k]} vs {g['reference_ids'][k]}"
    prompt = html.escape(readable(g["prompt"].encode()))
    return (
        f"<tr{mark}><td class='tok'>{prompt}</td><td class='tok'>{_html_continuation(g, 'engine')}</td>"
        f"<td class='tok'>{_html_continuation(g, 'reference')}</td><td>{where}</td></tr>"
    )
