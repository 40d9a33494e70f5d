"""The run header and the generic JSON round trip of a Result (io.to_jsonable / io.from_jsonable)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import pytest

from me_interp import io
from me_interp.study import CommonConfig, RunHeader, roundtrip, run_header


@dataclass(frozen=True)
class Row:
    layer: int
    value: float
    dims: tuple[int, ...] = ()
    note: str | None = None


@dataclass(frozen=True)
class Result:
    header: RunHeader
    rows: list[Row]
    per_layer: dict[str, list[float]] = field(default_factory=dict)
    pair: tuple[int, float] = (0, 0.0)
    best: Row | None = None


def _result() -> Result:
    h = RunHeader(model="m", bos="auto", prompts="built-in", n_prompts=3, seed=1, layer=2,
                  layer_1based=3, dims=(7, 1), n_units=2)  # fmt: skip
    rows = [Row(0, 1.5, (1, 2), "a"), Row(1, math.nan), Row(2, math.inf, note=None)]
    return Result(h, rows, {"x": [1.0, -math.inf]}, (3, 0.25), rows[0])


def test_a_result_goes_to_json_and_back():
    r = _result()
    text = json.dumps(io.to_jsonable(r))  # valid JSON: no NaN literals
    back = io.from_jsonable(Result, json.loads(text))
    assert back.header == r.header and back.pair == r.pair and back.best == r.best
    assert back.rows[0] == r.rows[0] and math.isnan(back.rows[1].value)
    assert back.rows[2].value == math.inf and back.per_layer["x"][1] == -math.inf
    assert io.to_jsonable(roundtrip(r)) == io.to_jsonable(r)


def test_from_jsonable_refuses_what_does_not_fit():
    with pytest.raises(TypeError):
        io.from_jsonable(int, "3")
    with pytest.raises(TypeError):
        io.from_jsonable(int | None, 2.5)  # neither an int nor None

    @dataclass
    class Custom:
        a: int

        def to_dict(self):
            return {"b": self.a}

    with pytest.raises(TypeError, match="to_dict"):
        io.from_jsonable(Custom, {"b": 1})


def test_run_header_from_a_site(planted):
    from me_interp.probes.site import locate

    model, plant = planted
    batch = model.tokenize(["w1 w2 w3 w4", "w5 w6 w7 w8"])
    site = locate(model, batch)
    h = run_header(CommonConfig(seed=4), model, len(batch), site)
    assert (h.layer, h.layer_1based, h.me_layer, h.layer_given) == (
        plant.layer,
        plant.layer + 1,
        plant.layer,
        False,
    )
    assert h.dims == (plant.massive_dim,) and h.position == 0 and h.n_units == 1 and h.seed == 4
    assert run_header(CommonConfig(), model, 2).layer is None
