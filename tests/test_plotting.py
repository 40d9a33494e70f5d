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
