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


def test_layer_panels_one_legend_entry_per_series_and_a_line_in_each_panel():
    fig = plotting.layer_panels(
        {"a": {"x": [1.0, 2.0], "y": [3.0, 4.0]}, "b": {"x": [5.0, 6.0], "y": [7.0, 8.0]}},
        "t",
        me_layer=1,
        colors=("red",),
        hline=10.0,
    )
    assert [t.name for t in fig.data] == ["x", "y", "x", "y"]
    assert [t.showlegend for t in fig.data] == [True, True, False, False]
    assert fig.data[2].line.color == "red" and fig.data[3].line.color is None
    assert list(fig.data[3].y) == [7.0, 8.0] and fig.data[3].xaxis == "x2"
    dotted = [s for s in fig.layout.shapes if s.line.dash == "dot"]
    assert len(dotted) == 2 and {s.y0 for s in dotted} == {10.0}
    assert fig.layout.yaxis.type == fig.layout.yaxis2.type == "log"


def test_bars_values_points_and_reference():
    fig = plotting.bars(
        {"a": 1.0, "b": 2.0}, "t", "y", reference=3.0, points={"seeds": [4.0, 5.0]}, xaxis_title="x"
    )
    assert list(fig.data[0].x) == ["a", "b"] and list(fig.data[0].y) == [1.0, 2.0]
    assert list(fig.data[1].x) == ["seeds", "seeds"] and list(fig.data[1].y) == [4.0, 5.0]
    assert [s.y0 for s in fig.layout.shapes] == [3.0] and fig.layout.yaxis.type == "log"
    assert fig.layout.xaxis.title.text == "x" and not fig.layout.annotations
    assert len(plotting.bars({"a": 1.0}, "t", "y").data) == 1


def test_lines_series_markers_and_reference():
    fig = plotting.lines(
        {"a": ([1, 2], [3.0, 4.0]), "b": ([2], [5.0])}, "t", "x", "y", 6.0, {"b"}, log_x=True
    )
    assert [t.name for t in fig.data] == ["a", "b"] and list(fig.data[0].y) == [3.0, 4.0]
    assert fig.data[0].mode == "lines+markers" and fig.data[1].mode == "markers"
    assert fig.data[1].marker.symbol == "circle-open"
    assert [s.y0 for s in fig.layout.shapes] == [6.0] and not fig.layout.annotations
    assert fig.layout.xaxis.type == "log" and fig.layout.yaxis.type == "log"
    assert plotting.lines({}, "t", "x", "y").layout.xaxis.type is None


def test_tidy_makes_room_for_titles_and_labels_log_axes_in_full():
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    long = "word " * 30 + "<br><sup>a subtitle</sup>"
    fig = make_subplots(rows=1, cols=2, subplot_titles=["left", "right"], shared_yaxes=True)
    fig.add_trace(go.Bar(y=[150.0, 160.0]), row=1, col=1)
    fig.add_trace(go.Bar(y=[1.0, 2.0]), row=1, col=2)
    fig.update_yaxes(type="log").update_layout(title=long)
    plain = go.Figure(go.Scatter(y=[1, 2])).update_layout(title="one line")
    plotting.tidy(fig), plotting.tidy(plain)
    lines = fig.layout.title.text.split("<br>")
    assert len(lines) == 3 and all(len(x) <= plotting.TITLE_WIDTH for x in lines[:2])
    assert " ".join(lines[:2]).split() == ["word"] * 30  # wrapped, nothing lost
    # title lines centred in the margin, the subplot titles' room on either side of them
    assert fig.layout.margin.t == 2 * (plotting.LINE_PX + 10) + 3 * plotting.LINE_PX + 10
    assert plain.layout.margin.t is None  # plotly's default margin fits one line
    assert {ax.tickformat for ax in fig.select_yaxes()} == {"~g"}  # no bare "2 5 2 5"
    assert plain.layout.yaxis.tickformat is None
    assert all(ax.showticklabels for ax in fig.select_yaxes())  # the shared panel keeps labels
    before = fig.to_plotly_json()
    assert plotting.tidy(fig).to_plotly_json() == before  # tidying twice changes nothing
