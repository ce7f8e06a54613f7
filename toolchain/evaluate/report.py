"""The quality-regression report in three forms: report.json (everything), report.md (for a CI summary or a
pull request), report.html (self-contained: inline SVG plots, no script, no network)."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from toolchain.evaluate.quality import QualityReport


def write_reports(result: dict[str, Any], out_dir: Path) -> list[Path]:
    paths = [out_dir / "report.json", out_dir / "report.md", out_dir / "report.html"]
    paths[0].write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    paths[1].write_text(markdown(result), encoding="utf-8")
    paths[2].write_text(page(result), encoding="utf-8")
    return paths


def _verdict(result: dict[str, Any]) -> str:
    if not result["gates"]:
        return "no gates set"
    return "PASS" if result["passed"] else "REGRESSION"


def markdown(result: dict[str, Any]) -> str:
    q = QualityReport(**result["quality"])
    lines = [
        f"# Quality report: {_verdict(result)}",
        "",
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
            f"| {g['gate']} | {g['limit']:g} | {g['value']:.6g} | {'pass' if g['pass'] else '**FAIL**'} |"
            for g in result["gates"]
        ]
    diverged = [g for g in result["golden"] if not g["exact"]]
    if diverged:
        lines += ["", "## Golden prompts that diverged", ""]
        for g in diverged:
            lines += [
                f"- `{g['prompt']}` — first divergence at token {g['first_divergence']}",
                f"  - engine: `{g['engine']}`",
                f"  - reference: `{g['reference']}`",
            ]
    return "\n".join(lines) + "\n"


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
        f'<line x1="{pad}" y1="{height - pad}" x2="{width - 20}" y2="{height - pad}" stroke="#333"/>'
        + "".join(bars)
        + ticks
        + "</svg>"
    )


def _svg_line(values: list[float], title: str, width: int = 640, height: int = 220) -> str:
    pad = 40
    low = min(min(values, default=0.0), 0.9)
    span = max(1.0 - low, 1e-9)
    step = (width - 60) / max(len(values) - 1, 1)
    points = " ".join(
        f"{pad + k * step:.1f},{height - pad - (height - 2 * pad) * (v - low) / span:.1f}" for k, v in enumerate(values)
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" aria-label="{title}">'
        f'<text x="{pad}" y="18" font-size="13" font-weight="bold">{html.escape(title)}</text>'
        f'<text x="4" y="{pad}" font-size="9">100%</text>'
        f'<text x="4" y="{height - pad}" font-size="9">{100 * low:.0f}%</text>'
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
        f"<tr><td>{g['gate']}</td><td>{g['limit']:g}</td><td>{g['value']:.6g}</td>"
        f"<td style='color:{'#1d7a3a' if g['pass'] else '#b3261e'}'>{'pass' if g['pass'] else 'FAIL'}</td></tr>"
        for g in result["gates"]
    )
    hist = result["kld_histogram"]
    labels = [f"{e:.1e}" for e in hist["edges"][:-1]]
    golden = "".join(_golden_row(g) for g in result["golden"])
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>trtbuild quality report: {verdict}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 1000px; }}
table {{ border-collapse: collapse; margin: 1em 0; }} td, th {{ border: 1px solid #ccc; padding: 4px 10px; }}
table.num td:nth-child(n+2) {{ text-align: right; font-variant-numeric: tabular-nums; }}
.verdict {{ color: white; background: {color}; padding: 2px 10px; border-radius: 4px; }}
code, .tok {{ font-family: ui-monospace, monospace; }} .diff {{ background: #fde2e1; }}
</style></head><body>
<h1>Quality report <span class="verdict">{verdict}</span></h1>
<p>Engine <code>{html.escape(result["engine_dir"])}</code> against <code>{html.escape(result["reference"])}</code>
(transformers, float32) on <code>{html.escape(result["data"])}</code>: {q.tokens:,} tokens in {q.windows} windows of
{result["window"]}.</p>
<table class="num"><tr><th>metric</th><th>value</th></tr>{rows}</table>
{_table("Gates", ["gate", "limit", "value", "result"], gates, "num")}
<h2>Plots</h2>
{_svg_bars(hist["counts"], labels, "KLD per token (log10 bins)")}
{_svg_line(result["top1_by_position"], "Same top-1 by position in the window")}
{_table("Golden prompts", ["prompt", "engine", "reference", "first divergence"], golden)}
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
    return rows


def _golden_row(g: dict[str, Any]) -> str:
    mark = "" if g["exact"] else " class='diff'"
    where = "—" if g["first_divergence"] is None else f"token {g['first_divergence']}"
    return (
        f"<tr{mark}><td class='tok'>{html.escape(g['prompt'])}</td><td class='tok'>{html.escape(g['engine'])}</td>"
        f"<td class='tok'>{html.escape(g['reference'])}</td><td>{where}</td></tr>"
    )
