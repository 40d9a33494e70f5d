"""Every claim can come out both ways: it holds on one constructed model and fails on another.

The batteries run once per test run (``constructed_battery``, shared with the meta-tests and, on
disk, by pytest-xdist workers, which split them). The table
they give must equal the checked-in ``docs/falsifiability.json`` (regenerate with ``python -m
me_interp.falsifiability``), from which docs/claims.md shows each claim's holds-on / fails-on models.
"""

from __future__ import annotations

import pytest

from me_interp import battery, falsifiability


@pytest.mark.slow
@pytest.mark.parametrize("model", falsifiability.CONSTRUCTED)
def test_the_battery_finishes_on_every_constructed_model(model, constructed_battery):
    """No experiment fails on a constructed model (``claims_of`` raises naming the failures); each
    model's battery is one test, so pytest-xdist workers split them."""
    cs = falsifiability.claims_of(model, constructed_battery(model))
    assert {c["id"].split(".")[0] for c in cs} == set(battery.NAMES)


@pytest.fixture(scope="module")
def table(constructed_battery):
    constructed_battery.prefetch(falsifiability.CONSTRUCTED)  # those no other worker is running
    return falsifiability.table(
        {m: falsifiability.claims_of(m, constructed_battery(m)) for m in falsifiability.CONSTRUCTED}
    )


@pytest.mark.slow
def test_every_claim_holds_on_one_constructed_model_and_fails_on_another(table):
    assert falsifiability.unfalsifiable(table) == {}


@pytest.mark.slow
def test_every_stated_claim_is_in_the_table(table):
    ids = {s.id for e in battery.EXPERIMENTS for s in e.specs}
    assert set(table) == ids, set(table) ^ ids


@pytest.mark.slow
def test_the_checked_in_table_is_current(table):
    assert falsifiability.read_table() == table, (
        "docs/falsifiability.json is stale: run python -m me_interp.falsifiability"
    )


def test_unfalsifiable_names_what_is_missing():
    t = falsifiability.table(
        {
            "a": [{"id": "x.always", "kind": "claim", "verdict": "holds"}],
            "b": [{"id": "x.always", "kind": "claim", "verdict": "holds"}],
        }
    )
    assert falsifiability.unfalsifiable(t) == {"x.always": "no constructed model on which it fails"}
    t["x.always"]["kind"] = "control"
    assert falsifiability.unfalsifiable(t) == {}


def test_every_decoy_is_constructed():
    from me_interp import synthetic

    decoys = {f"synthetic:decoy-{k}" for k in synthetic.DECOYS}
    assert decoys <= set(falsifiability.CONSTRUCTED)
