"""Every declared run-time dependency is used: imported by me_interp, or named here with the reason."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
IMPORT_NAME = {"transformer-lens": "transformer_lens"}
INDIRECT = {
    "gguf": "transformers reads the bundled GGUF through it",
    "accelerate": "transformers needs it to load GGUF checkpoints",
    "safetensors": "transformers writes and reads the fp32 model cache with it",
}


def test_every_dependency_is_imported_or_explained():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    source = "\n".join(p.read_text() for p in (ROOT / "me_interp").rglob("*.py"))
    unused = []
    for dep in deps:
        name = re.split(r"[<>=!~ \[]", dep, maxsplit=1)[0]
        module = IMPORT_NAME.get(name, name.replace("-", "_"))
        if name in INDIRECT:
            continue
        if not re.search(rf"^\s*(import|from) {module}\b", source, re.M):
            unused.append(name)
    assert unused == [], f"declared but never imported: {unused}"


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("probes", ("interventions", "edits", "experiments", "patching", "report")),
        ("selection.py", ("probes", "interventions", "edits", "experiments")),
        ("claims.py", ("probes", "interventions", "edits", "experiments", "models")),
    ],
)
def test_dependencies_point_one_way(package, forbidden):
    """Probes never import an intervention (the selection rules are on the ground floor) nor an
    experiment; the claim engine and the selection rules import no model code."""
    path = ROOT / "me_interp" / package
    files = [path] if path.is_file() else sorted(path.rglob("*.py"))
    pattern = re.compile(rf"^\s*(from|import) me_interp\.({'|'.join(forbidden)})\b", re.M)
    bad = [
        f"{f.name}: {m.group(0).strip()}" for f in files for m in pattern.finditer(f.read_text())
    ]
    assert bad == []
