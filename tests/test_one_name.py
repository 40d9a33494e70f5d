"""One name per idea: a public name is defined in one module only (issue 12, "One name per idea")."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "me_interp").rglob("*.py")) + sorted((ROOT / "experiments").rglob("*.py"))

#: Names that once meant two different things in two modules.
WATCHED = (
    "find_me_layer",
    "others_mean",
    "SITES",
    "check_layers",
    "singular_values",
    "LayerReport",
    "DetectConfig",
)


def _top_level_definitions(path: Path) -> set[str]:
    """Names a module defines at top level (def, class, assignment), not those it imports."""
    out: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Assign):
            out |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
    return out


@pytest.mark.parametrize("name", WATCHED)
def test_name_defined_in_one_module(name):
    where = [str(p.relative_to(ROOT)) for p in SOURCES if name in _top_level_definitions(p)]
    assert len(where) <= 1, f"{name} is defined in {where}"


def test_one_topk_abs_implementation():
    """``TopK(|x|, k)`` (a stable sort of ``|x|``) is written once; the others call it."""
    pattern = re.compile(r"sort\(\s*-?\w+\.detach\(\)\.abs\(\)")
    where = [str(p.relative_to(ROOT)) for p in SOURCES if pattern.search(p.read_text())]
    assert len(where) == 1, f"TopK-|x| implemented in {where}"


def test_topk_abs_callers_agree():
    """The gain-dim selections of the probes, the edits and WeMask are the same ``TopK(|w|, k)``."""
    import torch

    from me_interp.edits.gains import top_dims
    from me_interp.interventions.core import top_abs_dims
    from me_interp.probes.alignment import top_gain_dims

    w = torch.tensor([0.5, -3.0, 3.0, 0.1, -2.0, 2.0])  # ties at |3| and |2|: lower index first
    assert top_abs_dims(w, 4).tolist() == [1, 2, 4, 5]
    assert top_gain_dims(w, 4).tolist() == [1, 2, 4, 5]
    assert top_dims(w, 4) == [1, 2, 4, 5]


@pytest.mark.parametrize(
    ("name", "module"),
    [
        ("DetectConfig", "config"),
        ("WeightConfig", "config"),
        ("Detection", "layer_report"),
        ("LayerReport", "layer_report"),
        ("detect", "layer_report"),
        ("PART_ORDER", "weights"),
    ],
)
def test_shared_report_pieces_live_in_the_framework(name, module):
    """The pieces the per-layer reports and the weight experiments share live in the framework
    (``me_interp/study``), not in one experiment that its siblings import."""
    where = [str(p.relative_to(ROOT)) for p in SOURCES if name in _top_level_definitions(p)]
    assert where == [f"me_interp/study/{module}.py"]
