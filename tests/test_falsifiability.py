"""Every claim can come out both ways: it holds on one constructed model and fails on another.

The batteries run once per session (``constructed_battery``, shared with the meta-tests). The table
they give must equal the checked-in ``docs/falsifiability.json`` (regenerate with ``python -m
me_interp.falsifiability``), from which docs/claims.md shows each claim's holds-on / fails-on models.
"""

from __future__ import annotations

import pytest

from me_interp import falsifiability, report


@pytest.fixture(scope="module")
def table(constructed_battery):
    return falsifiability.table(
        {m: falsifiability.claims_of(m, constructed_battery(m)) for m in falsifiability.CONSTRUCTED}
    )


def test_every_claim_holds_on_one_constructed_model_and_fails_on_another(table):
    assert falsifiability.unfalsifiable(table) == {}


def test_every_stated_claim_is_in_the_table(table):
    ids = {s.id for m in report.MODULES for s in m.SPECS}
    assert set(table) == ids, set(table) ^ ids


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
