"""docs/adding_an_experiment.md: its worked example is real code. The module is read from the page,
imported, and run through the framework: its claim holds on the model built for it and fails on the
one built against it; the CLI, the declared checks and the Result's round trip work as the page says."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from me_interp import claims, falsifiability, io, load_model, study

DOC = Path(__file__).resolve().parents[2] / "docs" / "adding_an_experiment.md"


@pytest.fixture(scope="module")
def first_token(tmp_path_factory):
    code = re.search(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S).group(1)
    path = tmp_path_factory.mktemp("example") / "first_token.py"
    path.write_text(code, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("first_token_example", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def _outcome(module, name: str, tmp_path: Path):
    prompts = tmp_path / f"{name.split(':')[1]}.txt"
    prompts.write_text("\n".join(falsifiability.prompts(name)) + "\n", encoding="utf-8")
    cfg = module.Config(prompts=str(prompts), out=str(tmp_path))
    return study.execute(module.EXPERIMENT, cfg, load_model(name, device="cpu"))


def test_the_claim_holds_on_the_model_built_for_it(first_token, tmp_path):
    out = _outcome(first_token, "synthetic:planted-nobos", tmp_path)
    (c,) = out.claims
    assert c.verdict == claims.HOLDS and c.estimate.n == 16
    assert all(p == [0] for p in out.result.positions)
    back = study.roundtrip(out.result)
    assert io.to_jsonable(back) == io.to_jsonable(out.result)


def test_the_claim_fails_on_the_model_built_against_it(first_token, tmp_path):
    out = _outcome(first_token, "synthetic:decoy-later", tmp_path)
    (c,) = out.claims
    assert c.verdict == claims.FAILS
    assert all(2 in p for p in out.result.positions)


def test_not_applicable_without_a_massive_activation(first_token, tmp_path):
    out = _outcome(first_token, "synthetic:twin-nobos", tmp_path)
    assert out.result is None and out.not_applicable.startswith("no massive activation")
    assert [c.verdict for c in out.claims] == [claims.NOT_APPLICABLE]


def test_the_command_line(first_token, tmp_path, capsys):
    argv = ["--model", "synthetic:planted", "--out", str(tmp_path)]
    assert first_token.main([*argv, "--max-prompts", "-1"]) == 2
    assert capsys.readouterr().err.startswith("error: --max-prompts must be >= 0, got -1")
    assert first_token.main([*argv, "--max-prompts", "8"]) == 0
    run_dir = next((tmp_path / "first_token").iterdir())
    result = io.read_result(first_token.Result, run_dir)
    assert result.header.n_prompts == 8 and (run_dir / "positions.html").is_file()
