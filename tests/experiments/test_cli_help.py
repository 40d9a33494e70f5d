"""Every experiment flag has help text: each Config field is described in an ``Attributes:`` section."""

from __future__ import annotations

import dataclasses
import importlib

import pytest

from me_interp.battery import NAMES as EXPERIMENTS
from me_interp.study import CommonConfig, build_parser, field_docs


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_config_field_is_documented(name):
    config_cls = importlib.import_module(f"me_interp.experiments.{name}").Config
    docs = field_docs(config_cls)
    missing = [f.name for f in dataclasses.fields(config_cls) if not docs.get(f.name, "").strip()]
    assert not missing, f"{name}.Config: no Attributes: entry for {missing}"


def test_field_docs_reports_an_undocumented_field():
    @dataclasses.dataclass(frozen=True)
    class Partly(CommonConfig):
        """Test settings.

        Attributes:
            documented: described here,
                over two lines.
        """

        documented: int = 0
        undocumented: int = 0

    docs = field_docs(Partly)
    assert docs["documented"] == "described here, over two lines."
    assert "undocumented" not in docs


@pytest.mark.parametrize("name", (*EXPERIMENTS, "survey"))
def test_help_reads_well(name, monkeypatch):
    """No doc markup; a tuple default as it is typed; each default and each choice list once."""
    monkeypatch.setenv("COLUMNS", "10000")  # one line per flag
    module = importlib.import_module(f"me_interp.experiments.{name}")
    text = build_parser(module.Config, name, module.__doc__).format_help()
    for mark in ("``", ":mod:", ":class:", ":func:", ":data:", "('", "(default)"):
        assert mark not in text, f"{name} --help: {mark!r}"
    for line in text.splitlines():
        assert line.count("(default: ") <= 1 and "[{" not in line, line
