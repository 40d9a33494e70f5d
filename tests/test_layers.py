"""The package's floors (docs/conventions.md, "Where code lives"): every module imports only from its
own floor or the floors below it, and no set of modules imports itself in a circle. Imports are read
from the source (every ``import``, also inside functions; ``if TYPE_CHECKING:`` blocks excepted)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "me_interp"

FLOORS: list[tuple[str, tuple[str, ...]]] = [  # the top floor first
    ("commands", ("__main__", "falsifiability", "lm_eval", "training", "tasks")),
    ("battery", ("battery", "report")),
    ("experiments", ("experiments",)),
    ("framework", ("study",)),
    ("library", ("probes", "interventions", "edits", "patching", "evaluation", "backends",
                 "viewer", "plotting")),
    ("base", ("claims", "architecture", "names", "loading", "prompts", "io", "terminal",
              "synthetic", "models", "usage", "selection", "packaged", "data")),
]  # fmt: skip


def _modules() -> dict[str, Path]:
    out = {}
    for p in PACKAGE.rglob("*.py"):
        parts = ("me_interp", *p.relative_to(PACKAGE).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    def resolve(name: str) -> str:
        while name not in mods and "." in name:
            name = name.rsplit(".", 1)[0]
        return name

    edges: dict[str, set[str]] = defaultdict(set)
    for m, p in mods.items():
        tree = ast.parse(p.read_text(encoding="utf-8"))
        skip = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)
        }
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = m.split(".") if p.name == "__init__.py" else m.split(".")[:-1]
                    base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
                names = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names
                ]
            else:
                continue
            edges[m] |= {resolve(n) for n in names if n.startswith("me_interp")} - {m}
    return edges


def _floor(module: str) -> int | None:
    if module == "me_interp":
        return None  # the public API re-exports from every floor
    rest = module.split(".")[1]
    for i, (_, prefixes) in enumerate(FLOORS):
        if rest in prefixes:
            return len(FLOORS) - i
    raise AssertionError(f"{module} is on no floor: add it to FLOORS (and docs/conventions.md)")


def test_no_import_points_up():
    mods = _modules()
    up = [
        f"{m} -> {t}"
        for m, ts in _imports(mods).items()
        for t in ts
        if None not in (_floor(m), _floor(t)) and _floor(t) > _floor(m)
    ]
    assert up == []


def test_no_import_circle():
    edges = _imports(_modules())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                comp.append(w)
            if comp:
                circles.append(sorted([v, *comp]))

    for v in list(edges):
        if v not in index:
            visit(v)
    assert circles == []
