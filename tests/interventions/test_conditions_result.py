"""The questions a Result of the named conditions answers (``interventions.conditions.Conditions``)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from me_interp import claims
from me_interp.interventions.conditions import Conditions


@dataclass(frozen=True)
class Cond:
    name: str
    me_ratio: list[float]
    last_ratio: list[float]


@dataclass(frozen=True)
class Runs(Conditions):
    conditions: list[Cond]


BASE = Cond("baseline", [41.0, 61.0], [21.0, 31.0])


def test_of_and_not_run_name_a_missing_condition():
    r = Runs([BASE, Cond("cap_ffn", [1.0, 1.0], [1.0, 1.0])])
    assert r.of("cap_ffn").me_ratio == [1.0, 1.0] and r.not_run("cap_ffn") is None
    assert r.of("zero_dims") is None
    assert r.not_run("zero_dims") == "the condition zero_dims was not run (--conditions)"


def test_excess_is_the_excess_fraction_of_the_prompt_means():
    r = Runs([BASE, Cond("x", [6.0, 6.0], [2.0, 4.0])])
    assert r.excess("x") == pytest.approx((3.0 - 1) / (26.0 - 1))
    assert r.excess("x", last=False) == pytest.approx((6.0 - 1) / (51.0 - 1))
    assert r.excess("x") == claims.excess_fraction(3.0, 26.0)


def test_not_removed_positive_an_ordinary_token_everywhere():
    r = Runs([BASE, Cond("x", [1.0, 1.5], [1.0, 2.0])])
    assert r.not_removed("x", "the cap") is None


def test_not_removed_negative_still_massive_at_the_last_layer_only_when_read_there():
    r = Runs([BASE, Cond("x", [1.0, 1.0], [20.0, 20.0])])
    why = r.not_removed("x", "the cap")
    assert why is not None and why.startswith("the cap did not make the massive token ordinary")
    assert "20× at the last layer" in why
    assert r.not_removed("x", "the cap", at_last=False) is None
