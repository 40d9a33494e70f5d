"""The helpers the experiment modules share: choice checks, verdict lines, the shared config bases."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Literal

import pytest

from me_interp import claims, study, terminal
from me_interp import study as common
from me_interp.probes.measurement import EDIT_COLUMNS, EditRow, Measurement
from me_interp.study import DetectConfig


@dataclasses.dataclass(frozen=True)
class Declared(study.CommonConfig):
    cut: int = study.checked(16, ge=2, also=(0,))
    alpha: float = study.checked(0.5, ge=0, finite=True)
    coord: tuple[int, ...] = study.checked((), length=3, ge=0)
    names: tuple[str, ...] = study.checked(("a",), choices=("a", "b"), nonempty=True, unique=True)
    mode: Literal["x", "y"] = "x"


def test_declared_checks_accept_their_values():
    cfg = Declared(cut=0, alpha=0.0, coord=(1, 2, 3), names=("b", "a"), mode="y")
    assert (cfg.cut, cfg.coord, cfg.mode) == (0, (1, 2, 3), "y")
    assert Declared(cut=2, coord=()).coord == ()  # empty: not given; length counts a given tuple


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"cut": 1}, "cut must be >= 2 (or 0), got 1"),
        ({"alpha": math.inf}, "alpha must be finite, got inf"),
        ({"alpha": -1.0}, "alpha must be >= 0, got -1.0"),
        ({"coord": (1, 2)}, "coord must hold 3 values, got (1, 2)"),
        ({"coord": (1, 2, -1)}, "coord must all be >= 0, got -1"),
        ({"names": ()}, "names must hold at least one value"),
        ({"names": ("a", "a")}, "names repeats a value: ('a', 'a')"),
        ({"names": ("c",)}, "unknown names 'c'; choose from a, b"),
        ({"mode": "z"}, "unknown mode 'z'; choose from x, y"),  # a Literal is its choices
    ],
)
def test_declared_checks_refuse_in_one_wording(bad, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Declared(**bad)


def test_verbose_lines_one_per_claim_kinds_marked():
    x = [0.8, 0.85, 0.9, 0.95, 1.0]  # five distinct units: at least 'min_units'
    specs = [
        claims.Spec("x.a", "§1", "A holds", "fraction", ">=", "moved_fraction", "twin",
                    stat=lambda r: claims.Sample(x)),
        claims.Spec("x.b", "§1", "B by construction", "cell", ">=", "restore", kind="sanity",
                    stat=lambda r: claims.Sample([1.0] * 5)),
        claims.Spec("x.c", "§1", "C as designed", "cell", ">=", "restore", kind="control",
                    stat=lambda r: claims.Sample(x)),
    ]  # fmt: skip
    lines = [terminal.verbose_line(c) for c in claims.judge(specs, None, seed=0)]
    assert lines[0].startswith("[holds] x.a (§1): A holds — fraction = 0.9 [0.84, 0.96]")
    assert lines[1].startswith("(sanity check) [holds] x.b")
    assert lines[2].startswith("(control) [holds] x.c")


def test_site_config_validates_the_layer():
    assert common.SiteConfig(layer=0, position=3).position == 3
    with pytest.raises(ValueError, match="layer must be >= 0"):
        common.SiteConfig(layer=-1)


def test_detect_config_validates_the_criterion():
    assert DetectConfig(criterion="norm", position="zero").position == "zero"
    with pytest.raises(ValueError, match="criterion"):
        DetectConfig(criterion="loud")


def test_edit_row_and_cells():
    """An edit's row against the measurement by hand: R at the layer and the last, the sink after
    it, and the excess c = (mean R_m(edited) - 1) / (mean R_m(unedited) - 1)."""
    after = Measurement(
        me_layer=1,
        event_layers=[1],
        has_massive=[False, True, True],
        top_ratio=[1.0, 50.0, 40.0],
        max_over_median=[1.0, 2.0, 3.0],
        sink=[0.1, 0.2, 0.6],
        prompt_ratio=[[1.0, 1.0], [41.0, 61.0], [40.0, 40.0]],
    )
    before = dataclasses.replace(after, prompt_ratio=[[1.0, 1.0], [101.0, 101.0], [90.0, 90.0]])
    row = EditRow.measured(after, before, 1)
    assert (row.me_layer, row.survives, row.ratio_at_layer, row.ratio_last) == (1, True, 50.0, 40.0)
    assert row.sink_downstream == pytest.approx(0.6)
    assert row.ratio_at_layer_per_prompt == [41.0, 61.0]
    assert row.change == pytest.approx((51.0 - 1) / (101.0 - 1))
    assert len(row.cells()) == len(EDIT_COLUMNS) and row.cells()[:2] == (1, "yes")


def _raised(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects what was raised
        return e
    raise AssertionError("nothing raised")


def test_is_bad_input_tells_validation_from_bugs():
    import torch

    from me_interp.models import ModelLoadError

    assert common.is_bad_input(_raised(lambda: common.CommonConfig(bos="maybe")))
    assert common.is_bad_input(ModelLoadError("no such model"))
    assert common.is_bad_input(FileNotFoundError("prompts.txt"))
    # a ValueError raised inside torch, a RuntimeError, a type-check failure: bugs
    assert not common.is_bad_input(_raised(lambda: torch.distributions.Normal(0.0, -1.0)))
    assert not common.is_bad_input(RuntimeError("shape mismatch"))
    assert not common.is_bad_input(
        _raised(lambda: claims.Spec("x.y", "§1", "s", "t", op=1, threshold="jump"))
    )


def test_cli_keeps_the_traceback_of_a_bug(monkeypatch, tmp_path, capsys):
    import torch

    from me_interp.experiments import me_layer

    argv = ["--model", "synthetic:planted", "--out", str(tmp_path)]

    def bug(cfg, model=None, site=None):
        return torch.distributions.Normal(0.0, -1.0)

    buggy = dataclasses.replace(me_layer.EXPERIMENT, run=bug)
    with pytest.raises(ValueError, match="scale"):
        study.main(buggy, argv)
    assert (
        me_layer.main(
            [
                "--model",
                "synthetic:planted",
                "--bos",
                "yes",
                "--seed",
                "-1",
                "--out",
                str(tmp_path),
                "--threads",
                "0",
            ]
        )
        == 2
    )
    assert capsys.readouterr().err.startswith("error: --seed must be >= 0")  # the first field
