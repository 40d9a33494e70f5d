"""Figure helpers: a series that is flat to float noise still gets a drawable y range."""

from __future__ import annotations

from me_interp import plotting


def test_flat_series_get_a_padded_range_and_others_autorange():
    flat = plotting.layer_lines({"cos": [1.0, 1.0, 0.9999999999999999, float("nan")]}, "t", "cos")
    lo, hi = flat.layout.yaxis.range
    assert lo < 0.99 and hi > 1.01
    varied = plotting.layer_lines({"cos": [0.5, 0.9, float("nan")]}, "t", "cos")
    assert varied.layout.yaxis.range is None
    empty = plotting.layer_lines({"cos": [float("nan"), float("nan")]}, "t", "cos")
    assert empty.layout.yaxis.range is None
