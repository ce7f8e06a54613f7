"""The release-diff report (`trtbuild diff -o DIR`) in three forms: report.json (everything), report.md (for a CI
summary or a pull request), report.html (self-contained: inline SVG, no script, no network). The change table
comes first; then quality and speed, OLD and NEW side by side. The plots follow eval's report style."""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from toolchain.evaluate.golden import readable
from toolchain.evaluate.report import _md_code, write_report_files
from toolchain.evaluate.report import spec_lines as eval_spec_lines

OLD_COLOR, NEW_COLOR, REF_COLOR = "#8c8c8c", "#4a7bd0", "#d0574a"
SERIES = {  # quality series -> (label, color)
    "new_vs_old": ("NEW vs OLD", NEW_COLOR),
    "old_vs_reference": ("OLD vs reference", OLD_COLOR),
    "new_vs_reference": ("NEW vs reference", REF_COLOR),
}


def write_reports(result: dict[str, Any], out_dir: Path) -> list[Path]:
    return write_report_files(out_dir, result, markdown(result), page(result))


def verdict(result: dict[str, Any]) -> str:
    if result.get("quality_refused"):
        return "QUALITY REFUSED"
    if not result["gates"]:
        return "no gates set"
    return "PASS" if result["passed"] else "REGRESSION"


def short(value: Any) -> str:
    """A table cell: hashes cut to 12 characters, None as '-'."""
    if value is None:
        return "-"
    text = json.dumps(value) if isinstance(value, (list, dict, bool)) else str(value).replace("\n", "\\n")
    if len(text) == 64 and all(c in "0123456789abcdef" for c in text):
        return text[:12]
    return text if len(text) <= 60 else text[:57] + "..."


def change_lines(result: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    return [(r["section"], r["key"], short(r["old"]), short(r["new"])) for r in result["changes"] if r["changed"]]


def summary_line(result: dict[str, Any]) -> str:
    if result["same_build"]:
        same = "same source weights, recipe, quantization, limits, backend, engine files and versions"
        if result.get("same_machine", True):
            return f"identical builds: {same}"
        moved = [r["key"] for r in result["changes"] if r.get("context") and r["changed"]]
        return f"identical builds on different machines: {same}; the machines differ in {', '.join(moved)}"
    rows = [r for r in result["changes"] if not r.get("context")]
    unknown = [r for r in rows if r.get("unknown")]
    line = f"{result['changed']} of {len(rows) - len(unknown)} recorded settings differ"
    if unknown:
        where = dict.fromkeys(f"{r['section']} ({' and '.join(r['unknown'])})" for r in unknown)
        line += (
            f"; {len(unknown)} not compared, their stage manifests not found: {', '.join(where)} (keep an engine in "
            "its run dir, or beside the checkpoint dirs it was built from, for the whole record)"
        )
    return line


def md_cell(text: str) -> str:
    """`text` as a code span inside a markdown table row (a `|` would end the cell)."""
    return _md_code(text).replace("|", "\\|")


def quality_rows(q: dict[str, Any]) -> list[tuple[str, str]]:
    n = q["new_vs_old"]
    rows = [
        ("mean KLD (NEW vs OLD)", f"{n['kld_mean']:.6f}"),
        ("KLD p50 / p90 / p99", f"{n['kld_p50']:.6f} / {n['kld_p90']:.6f} / {n['kld_p99']:.6f}"),
        ("same top-1", f"{100 * n['same_top1']:.2f} %"),
        ("PPL OLD / NEW", f"{n['ppl_reference']:.4f} / {n['ppl_variant']:.4f}"),
        ("PPL ratio NEW/OLD", f"{n['ppl_ratio']:.5f}"),
    ]
    if "old_vs_reference" in q:
        o, w = q["old_vs_reference"], q["new_vs_reference"]
        rows += [
            ("vs reference: mean KLD OLD / NEW", f"{o['kld_mean']:.6f} / {w['kld_mean']:.6f}"),
            ("vs reference: same top-1 OLD / NEW", f"{100 * o['same_top1']:.2f} % / {100 * w['same_top1']:.2f} %"),
            ("vs reference: PPL ratio OLD / NEW", f"{o['ppl_ratio']:.5f} / {w['ppl_ratio']:.5f}"),
        ]
    return rows


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{1e3 * value:.1f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def speed_rows(s: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    o, n, r = s["old"], s["new"], s["ratios"]
    rows = [("output tok/s", f"{o['output_tok_s']:.1f}", f"{n['output_tok_s']:.1f}", _x(r["throughput_ratio"]))]
    for metric, name in (("ttft", "TTFT"), ("tpot", "TPOT")):
        for p in ("p50", "p90"):
            old, new = o[f"{metric}_s"][p], n[f"{metric}_s"][p]
            rows.append((f"{name} {p} ms", _ms(old), _ms(new), _x(r[f"{metric}_{p}_ratio"])))
    return rows


def gate_cell(g: dict[str, Any]) -> str:
    return "-" if g["value"] is None else f"{g['value']:.6g}"


def spec_lines(speculative: dict[str, Any]) -> list[str]:
    """Both engines' speculative golden replays (engine_eval.spec_golden): NEW in full, OLD's acceptance beside it."""
    new, old = speculative["new"], speculative["old"]
    rate = old["acceptance_rate"]
    ratio = None if rate is None or new["acceptance_rate"] is None or not rate else new["acceptance_rate"] / rate
    return [
        *eval_spec_lines(new, "NEW speculative"),
        f"OLD speculative acceptance {'-' if rate is None else format(rate, '.3f')}, {100 * old['spec_equal']:.1f} % "
        f"token-identical; acceptance NEW/OLD {'-' if ratio is None else format(ratio, '.3f')}",
    ]


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# Release diff: {verdict(result)}",
        "",
        f"OLD `{result['old']['path']}` ({result['old']['kind']}, engine manifest "
        f"{result['old']['manifest_sha256'][:12]}) → NEW `{result['new']['path']}` ({result['new']['kind']}, "
        f"engine manifest {result['new']['manifest_sha256'][:12]}).",
        "",
        "## What changed",
        "",
        summary_line(result) + ".",
    ]
    changed = change_lines(result)
    if changed:
        lines += ["", "| section | key | OLD | NEW |", "|---|---|---|---|"]
        lines += [f"| {s} | {md_cell(k)} | {md_cell(a)} | {md_cell(b)} |" for s, k, a, b in changed]
    if result["quality_refused"]:
        lines += ["", f"**Quality comparison refused:** {result['quality_refused']}"]
    q = result["quality"]
    if q is not None:
        n = q["new_vs_old"]
        lines += ["", "## Quality", "", f"On `{result['data']}`: {n['tokens']:,} tokens in windows of {q['window']}."]
        lines += ["", "| metric | value |", "|---|---:|", *(f"| {k} | {v} |" for k, v in quality_rows(q))]
    if result["golden"] is not None:
        same = sum(g["same"] for g in result["golden"])
        lines += ["", "## Golden prompts", "", f"{same} of {len(result['golden'])} greedy outputs unchanged."]
        for g in (g for g in result["golden"] if not g["same"]):
            lines += [
                f"- {_md_code(readable(g['prompt'].encode()))} — first divergence at token {g['first_divergence']}",
                f"  - OLD: {_md_code(g['old'])} {g['old_tokens']}",
                f"  - NEW: {_md_code(g['new'])} {g['new_tokens']}",
            ]
    sp = result.get("speculative")
    if sp is not None:
        lines += ["", "## Speculative decoding (golden prompts)", ""]
        lines += [f"- {line.strip()}" for line in spec_lines(sp)]
    s = result["speed"]
    if s is not None:
        lines += [
            "",
            "## Speed",
            "",
            f"`{s['trace']}`: {s['requests']} requests, {s['rounds']} interleaved rounds (medians).",
            "",
            "| metric | OLD | NEW | NEW/OLD |",
            "|---|---:|---:|---:|",
            *(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in speed_rows(s)),
        ]
    if result["gates"]:
        lines += ["", "## Gates", "", "| gate | limit | value | result |", "|---|---:|---:|---|"]
        lines += [
            f"| {g['gate']} | {g['limit']:g} | {gate_cell(g)} | {'pass' if g['pass'] else '**FAIL**'} |"
            for g in result["gates"]
        ]
    return "\n".join(lines) + "\n"


def _legend(series: dict[str, tuple[list[float], str]], width: int) -> str:
    return "".join(
        f'<rect x="{width - 200}" y="{24 + 14 * s}" width="10" height="10" fill="{color}"/>'
        f'<text x="{width - 185}" y="{33 + 14 * s}" font-size="10">{html.escape(name)}</text>'
        for s, (name, (_, color)) in enumerate(series.items())
    )


def _svg_grouped(series: dict[str, tuple[list[float], str]], labels: list[str], title: str, unit: str = "") -> str:
    """Bars of several series side by side per label, y from 0; eval's plot frame and fonts."""
    width, height, pad = 640, 240, 40
    top = max([max(v, default=0.0) for v, _ in series.values()] + [1e-12])
    group = (width - 60) / max(len(labels), 1)
    bw = max((group - 2) / max(len(series), 1), 1.0)
    bars = []
    for s, (values, color) in enumerate(series.values()):
        for k, v in enumerate(values):
            h = (height - 2 * pad) * v / top
            x, y = pad + k * group + s * bw, height - pad - h
            bars.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{bw - 1:.1f}" height="{h:.1f}" fill="{color}"/>')
    ticks = "".join(
        f'<text x="{pad + k * group:.1f}" y="{height - pad + 14}" font-size="9">{html.escape(labels[k])}</text>'
        for k in range(0, len(labels), max(1, len(labels) // 6))
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
        f'aria-label="{html.escape(title)}">'
        f'<text x="{pad}" y="18" font-size="13" font-weight="bold">{html.escape(title)}</text>'
        f'<text x="4" y="{pad}" font-size="9">{top:.3g}{unit}</text>'
        f'<text x="4" y="{height - pad}" font-size="9">0</text>'
        f'<line x1="{pad}" y1="{height - pad}" x2="{width - 20}" y2="{height - pad}" stroke="#333"/>'
        + "".join(bars)
        + ticks
        + _legend(series, width)
        + "</svg>"
    )


def _svg_lines(series: dict[str, tuple[list[float], str]], title: str) -> str:
    """Fractions by position, one line per series, y from 0 % to 100 %."""
    width, height, pad = 640, 240, 40
    longest = max((len(v) for v, _ in series.values()), default=1)
    step = (width - 60) / max(longest - 1, 1)
    lines = []
    for values, color in series.values():
        points = " ".join(
            f"{pad + k * step:.1f},{height - pad - (height - 2 * pad) * v:.1f}" for k, v in enumerate(values)
        )
        lines.append(f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="1.5"/>')
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
        f'aria-label="{html.escape(title)}">'
        f'<text x="{pad}" y="18" font-size="13" font-weight="bold">{html.escape(title)}</text>'
        f'<text x="4" y="{pad}" font-size="9">100%</text><text x="10" y="{height - pad}" font-size="9">0%</text>'
        f'<line x1="{pad}" y1="{height - pad}" x2="{width - 20}" y2="{height - pad}" stroke="#333"/>'
        + "".join(lines)
        + f'<text x="{pad}" y="{height - pad + 14}" font-size="9">position 1</text>'
        f'<text x="{width - 90}" y="{height - pad + 14}" font-size="9">position {longest}</text>'
        + _legend(series, width)
        + "</svg>"
    )


def plots(result: dict[str, Any]) -> list[str]:
    out = []
    q = result["quality"]
    if q is not None:
        hist = q["kld_histogram"]
        labels = [f"{e:.1e}" for e in hist["edges"][:-1]]
        counts = {SERIES[k][0]: (v, SERIES[k][1]) for k, v in hist["counts"].items()}
        out.append(_svg_grouped(counts, labels, "KLD per token (log10 bins)"))
        top1 = {SERIES[k][0]: (v, SERIES[k][1]) for k, v in q["top1_by_position"].items()}
        out.append(_svg_lines(top1, "Same top-1 by position in the window"))
    s = result["speed"]
    if s is not None:
        labels = ["TTFT p50", "TTFT p90", "TPOT p50", "TPOT p90"]
        series = {
            side.upper(): (
                [1e3 * (s[side][f"{m}_s"][p] or 0.0) for m in ("ttft", "tpot") for p in ("p50", "p90")],
                color,
            )
            for side, color in (("old", OLD_COLOR), ("new", NEW_COLOR))
        }
        out.append(_svg_grouped(series, labels, "Latency, OLD and NEW (ms)", " ms"))
    return out


def _table(title: str, header: list[str], rows: Sequence[tuple[Any, ...]], css: str = "") -> str:
    if not rows:
        return ""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<h2>{html.escape(title)}</h2><table class='{css}'><tr>{head}</tr>{body}</table>"


def spec_rows(speculative: dict[str, Any] | None) -> list[tuple[str, str]]:
    """The speculative replays as (side, text) rows for report.html."""
    if speculative is None:
        return []
    new, *olds = spec_lines(speculative)
    return [("NEW", line.strip()) for line in [new, *olds[:-1]]] + [("OLD", olds[-1].removeprefix("OLD "))]


def page(result: dict[str, Any]) -> str:
    v = verdict(result)
    color = {"PASS": "#1d7a3a", "REGRESSION": "#b3261e", "QUALITY REFUSED": "#b3261e"}.get(v, "#555")
    old, new = result["old"], result["new"]
    gates = [(g["gate"], f"{g['limit']:g}", gate_cell(g), "pass" if g["pass"] else "FAIL") for g in result["gates"]]
    golden = [
        (g["prompt"], g["old"], g["new"], "—" if g["same"] else f"token {g['first_divergence']}")
        for g in result["golden"] or []
    ]
    refused = result["quality_refused"]
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>trtbuild release diff: {v}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 1000px; }}
table {{ border-collapse: collapse; margin: 1em 0; }} td, th {{ border: 1px solid #ccc; padding: 4px 10px; }}
table.num td:nth-child(n+2) {{ text-align: right; font-variant-numeric: tabular-nums; }}
.verdict {{ color: white; background: {color}; padding: 2px 10px; border-radius: 4px; }}
code, td {{ font-family: ui-monospace, monospace; }}
</style></head><body>
<h1>Release diff <span class="verdict">{v}</span></h1>
<p>OLD <code>{html.escape(old["path"])}</code> ({old["kind"]}, engine manifest {old["manifest_sha256"][:12]}) →
NEW <code>{html.escape(new["path"])}</code> ({new["kind"]}, engine manifest {new["manifest_sha256"][:12]}).</p>
<h2>What changed</h2><p>{html.escape(summary_line(result))}.</p>
{_table("Changes", ["section", "key", "OLD", "NEW"], change_lines(result))}
{f"<p><b>Quality comparison refused:</b> {html.escape(refused)}</p>" if refused else ""}
{_table("Quality", ["metric", "value"], quality_rows(result["quality"]) if result["quality"] else [], "num")}
{
        _table(
            "Speed (medians of interleaved rounds)",
            ["metric", "OLD", "NEW", "NEW/OLD"],
            speed_rows(result["speed"]) if result["speed"] else [],
            "num",
        )
    }
{_table("Speculative decoding (golden prompts)", ["side", "what"], spec_rows(result.get("speculative")))}
{_table("Gates", ["gate", "limit", "value", "result"], gates, "num")}
{"<h2>Plots</h2>" if result["quality"] or result["speed"] else ""}
{"".join(plots(result))}
{_table("Golden prompts", ["prompt", "OLD", "NEW", "first divergence"], golden)}
</body></html>
"""
