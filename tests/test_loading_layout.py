"""The loading package's layout: every module imports on its own (no import circle) and is small."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOADING = ROOT / "me_interp" / "loading"
MODULES = sorted(
    "me_interp.loading" + ("" if p.stem == "__init__" else f".{p.stem}")
    for p in LOADING.glob("*.py")
)
MAX_LINES = 450


def test_the_loading_modules_are_the_expected_ones():
    expected = {"bundled", "cache", "devices", "errors", "hf", "loaded", "packaged", "sources"}
    assert {m.rpartition(".")[2] for m in MODULES} >= expected | {"synthetic"}


FRESH_IMPORTS = """
import importlib, sys
import torch, transformers, jaxtyping  # third-party: imported once, they never import me_interp
failed = []
for module in sys.argv[1:]:
    for name in [m for m in sys.modules if m == "me_interp" or m.startswith("me_interp.")]:
        del sys.modules[name]
    try:
        importlib.import_module(module)
    except Exception as e:
        failed.append(f"{module}: {type(e).__name__}: {e}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_each_module_imports_alone():
    """Each module imported first, with no me_interp module loaded before it (one process, the
    me_interp modules dropped from ``sys.modules`` between imports; torch is imported once): a
    circle (a module importing one that imports it back before it is defined) fails here."""
    modules = [*MODULES, "me_interp.models", "me_interp.packaged", "me_interp.synthetic"]
    run = subprocess.run(
        [sys.executable, "-c", FRESH_IMPORTS, *modules], capture_output=True, text=True, cwd=ROOT
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]


def test_loading_and_packaged_import_together_either_way():
    """The check of the import circle there was (packaged imported models, models packaged), each
    order in a fresh process."""
    for order in ("me_interp.loading, me_interp.packaged", "me_interp.packaged, me_interp.loading"):
        run = subprocess.run(
            [sys.executable, "-c", f"import {order}"], capture_output=True, text=True, cwd=ROOT
        )
        assert run.returncode == 0, run.stderr[-2000:]


@pytest.mark.parametrize(
    "path",
    [
        *sorted(LOADING.glob("*.py")),
        ROOT / "me_interp" / "models.py",
        ROOT / "me_interp" / "packaged.py",
    ],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_module_is_small(path):
    n = len(path.read_text().splitlines())
    assert n <= MAX_LINES, f"{path.name} has {n} lines (at most {MAX_LINES})"


def test_loading_imports_no_facade():
    """Dependencies point one way: the facades import loading, never the reverse."""
    bad = [
        f"{p.name}: {line.strip()}"
        for p in LOADING.glob("*.py")
        for line in p.read_text().splitlines()
        if line.strip().startswith(("from me_interp.models", "from me_interp.packaged"))
        or line.strip().startswith(("import me_interp.models", "import me_interp.packaged"))
        or line.strip() in ("from me_interp import models", "from me_interp import packaged")
    ]
    assert bad == []


def test_facade_names_are_the_loading_objects():
    """``models.X`` is the object the loading modules use (so an isinstance check or a replaced
    attribute in a loading module is seen the same way through the facade)."""
    from me_interp import loading, models, packaged
    from me_interp.loading import bundled, cache, devices, loaded
    from me_interp.loading import packaged as loading_packaged

    assert models.load_model is loading.load_model and models.LoadedModel is loaded.LoadedModel
    assert (
        models.ensure_cache is cache.ensure_cache
        and models.resolve_device is devices.resolve_device
    )
    assert models.ensure_bundled_cache is bundled.ensure_bundled_cache
    assert packaged.PACKAGED is loading_packaged.PACKAGED
