"""Figure helpers: a series that is flat to float noise still gets a drawable y range."""

from __future__ import annotations

import math

from me_interp import plotting


def test_flat_series_get_a_padded_range_and_others_autorange():
    flat = plotting.layer_lines({"cos": [1.0, 1.0, 0.9999999999999999, float("nan")]}, "t", "cos")
    lo, hi = flat.layout.yaxis.range
    assert lo < 0.99 and hi > 1.01
    varied = plotting.layer_lines({"cos": [0.5, 0.9, float("nan")]}, "t", "cos")
    assert varied.layout.yaxis.range is None
    empty = plotting.layer_lines({"cos": [float("nan"), float("nan")]}, "t", "cos")
    assert empty.layout.yaxis.range is None


def test_heatmap_menu_one_panel_shown_at_a_time_and_counts_bar():
    fig = plotting.heatmap_menu({"a": [[1.0, float("nan")]], "b": [[2.0, 3.0]]}, "t", "x", "y", "c")
    assert [tr.visible for tr in fig.data] == [True, False]
    assert math.isnan(fig.data[0].z[0][1])  # a NaN cell stays empty (greyed)
    buttons = fig.layout.updatemenus[0].buttons
    assert [b.label for b in buttons] == ["a", "b"]
    assert [b.args[0]["visible"] for b in buttons] == [[True, False], [False, True]]
    bar = plotting.counts_bar({"'.'": 3, "'\\n'": 1}, "t", "x", "y")
    assert list(bar.data[0].x) == ["'.'", "'\\n'"] and list(bar.data[0].y) == [3, 1]
