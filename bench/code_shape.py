"""Measure the code's shape: function lengths, dicts crossing stage seams, package cycles, repeated code.

Prints one table. Used by issue 24 for its before/after figures; run it on two checkouts to compare:

    python bench/code_shape.py [ROOT]
"""

from __future__ import annotations

import ast
import statistics
import subprocess
import sys
from pathlib import Path

PACKAGE = "toolchain"


def functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def body_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    first = fn.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and len(fn.body) > 1:
        first = fn.body[1]  # a docstring is not code
    return (fn.end_lineno or fn.lineno) - first.lineno + 1


def returns_any_dict(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    ret = ast.unparse(fn.returns) if fn.returns else ""
    return ret.replace(" ", "").startswith(("dict[str,Any]", "dict[str,object]"))


def package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[0] == PACKAGE else None


def imports(path: Path, root: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    module = ".".join(path.relative_to(root).with_suffix("").parts)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:
                base = ".".join([*module.split(".")[: -node.level], node.module])
            found.add(base)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m.startswith(PACKAGE + ".")}


def cycles(edges: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """Every package pair or triple that reaches itself (short cycles are the ones a reader meets)."""
    found = set()
    for a in edges:
        for b in edges[a]:
            if a in edges.get(b, ()):
                found.add(tuple(sorted((a, b))))
            for c in edges.get(b, ()):
                if c not in (a, b) and a in edges.get(c, ()):
                    found.add(tuple(sorted((a, b, c))))
    return sorted(found)


def main(root: Path) -> None:
    files = sorted((root / PACKAGE).rglob("*.py"))
    lengths, any_dicts = [], 0
    edges: dict[str, set[str]] = {}
    for path in files:
        tree = ast.parse(path.read_text())
        fns = functions(tree)
        lengths += [body_lines(f) for f in fns]
        any_dicts += sum(returns_any_dict(f) for f in fns)
        src = package_of(".".join(path.relative_to(root).with_suffix("").parts))
        for target in imports(path, root):
            dst = package_of(target)
            if src and dst and dst != src:
                edges.setdefault(src, set()).add(dst)
    deciles = statistics.quantiles(lengths, n=10)
    dup = subprocess.run(
        ["duplicates", "--repo", str(root / PACKAGE), "--most", "1"], capture_output=True, text=True, check=False
    ).stdout.splitlines()
    rows = [
        ("source files", len(files)),
        ("functions", len(lengths)),
        ("function length median / p90 (lines)", f"{statistics.median(lengths):.0f} / {deciles[8]:.0f}"),
        ("functions returning dict[str, Any]", any_dicts),
        ("package cycles", ", ".join("↔".join(c) for c in cycles(edges)) or "none"),
        ("duplicates", dup[0] if dup else "(duplicates not on PATH)"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve())
