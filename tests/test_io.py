"""Atomic writing and JSON conversion."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import pytest
import torch

from me_interp import io


def test_to_jsonable_handles_tensors_dataclasses_and_nonfinite():
    @dataclass
    class R:
        x: torch.Tensor
        y: float

    out = io.to_jsonable(
        {"r": R(torch.tensor([1.0, 2.0]), math.inf), "n": float("nan"), "t": (1, 2)}
    )
    assert out == {"r": {"x": [1.0, 2.0], "y": "inf"}, "n": "nan", "t": [1, 2]}
    json.dumps(out, allow_nan=False)


def test_atomic_write_leaves_old_file_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "result.json"
    io.write_json(path, {"a": 1})

    class Boom(Exception):
        pass

    def explode(*a, **k):
        raise Boom

    monkeypatch.setattr(io.os, "replace", explode)
    with pytest.raises(Boom):
        io.write_json(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]


def test_load_run_refuses_incomplete(tmp_path):
    d = io.new_run_dir(tmp_path, "x")
    io.write_json(d / io.CONFIG_FILE, {})
    with pytest.raises(FileNotFoundError, match="did not finish"):
        io.read_run(d)


def test_prompt_files(tmp_path):
    from me_interp.prompts import builtin_prompts, read_prompts

    firsts = {p.split()[0] for p in builtin_prompts()}
    assert len(firsts) == len(builtin_prompts())  # all first words differ
    (tmp_path / "a.txt").write_text("one\n\n two \\n three\n")
    assert read_prompts(tmp_path / "a.txt") == ["one", " two \n three"]
    (tmp_path / "b.json").write_text('["x", "y"]')
    assert read_prompts(tmp_path / "b.json") == ["x", "y"]
    (tmp_path / "c.json").write_text('{"x": 1}')
    with pytest.raises(ValueError, match="list of strings"):
        read_prompts(tmp_path / "c.json")


def test_the_commit_is_read_once_per_process(monkeypatch):
    """A commit landing during a run does not relabel its results: the commit is read at import."""
    import subprocess

    from me_interp import io as mio

    first = mio.environment()["git_commit"]

    def boom(*a, **k):  # a later rev-parse would fail the test
        raise AssertionError("git rev-parse ran again")

    monkeypatch.setattr(subprocess, "run", boom)
    assert mio.environment()["git_commit"] == first
