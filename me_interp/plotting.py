"""Figures as plotly ``go.Figure`` objects (never shown here: the caller decides).

Conventions: x axes are 0-based layer indices (the hover shows 1-based too); the ME layer is marked
with a dashed vertical line; norms are on log axes.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from me_interp.architecture import (
    ATTN_OWN_SITE,
    ATTN_RESIDUAL_SITE,
    FFN_OWN_SITE,
    FFN_RESIDUAL_SITE,
)

if TYPE_CHECKING:
    from me_interp.patching.cells import Cells
    from me_interp.patching.sinkheads import SinkHeads

SITE_TITLES = {
    "resid_pre": "block input (resid_pre)",
    "attn_in": "pre-attention RMSNorm output",
    "attn_out": "attention output",
    "resid_mid": "after attention (resid_mid)",
    "ffn_in": "pre-FFN RMSNorm output",
    "ffn_out": "FFN output",
    "resid_post": "layer output (resid_post)",
    "attn_own": "attention's own output (before its post-norm)",
    "ffn_own": "FFN's own output (before the post-FFN norm)",
}

#: Titles of the residual-contribution sites on a sandwich-norm model, used when the sub-layer's own
#: output (the key of each pair) is drawn too: there ``attn_out`` / ``ffn_out`` are after the post-norm.
RESIDUAL_TITLES = {
    "attn_out": ("attn_own", "attention's residual contribution (after its post-norm)"),
    "ffn_out": ("ffn_own", "FFN's residual contribution (after the post-FFN norm)"),
}


def site_title(site: str, drawn: Sequence[str] = ()) -> str:
    """The panel title of ``site``; ``drawn``: every site of the figure (to name a residual
    contribution as such when the sub-layer's own output is drawn beside it)."""
    own, title = RESIDUAL_TITLES.get(site, (None, None))
    if own is not None and own in drawn:
        return title
    return SITE_TITLES.get(site, site)


def mark_layer(fig: go.Figure, layer: int | None, label: str = "ME layer", **kw) -> go.Figure:
    """Add a dashed vertical line at ``layer`` (0-based) to every subplot."""
    if layer is not None:
        fig.add_vline(
            x=layer,
            line_dash="dash",
            line_color="firebrick",
            annotation_text=f"{label} {layer} (1-based {layer + 1})",
            annotation_position="top right",
            **kw,
        )
    return fig


def layer_lines(
    series: Mapping[str, Sequence[float]],
    title: str,
    yaxis_title: str,
    me_layer: int | None = None,
    log_y: bool = False,
) -> go.Figure:
    """One line per named series over layers."""
    fig = go.Figure()
    for name, ys in series.items():
        xs = list(range(len(ys)))
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=list(ys),
                mode="lines+markers",
                name=name,
                customdata=[x + 1 for x in xs],
                hovertemplate="layer %{x} (1-based %{customdata}): %{y:.4g}<extra>"
                + name
                + "</extra>",
            )
        )
    fig.update_layout(
        title=title, xaxis_title="layer (0-based)", yaxis_title=yaxis_title, template="plotly_white"
    )
    if log_y:
        fig.update_yaxes(type="log")
    else:
        _pad_flat_range(fig, [y for ys in series.values() for y in ys])
    return mark_layer(fig, me_layer)


def _pad_flat_range(fig: go.Figure, ys: Sequence[float | None]) -> None:
    """Give the y axis a range when every finite value is (nearly) the same: plotly's autorange of a
    span of ~1e-16 (a cosine of exactly 1 in float noise) draws ticks and the axis title at infinity."""
    finite = [float(y) for y in ys if y is not None and math.isfinite(float(y))]
    if not finite:
        return
    lo, hi = min(finite), max(finite)
    if hi - lo <= 1e-9 * max(1.0, abs(hi)):
        pad = max(0.05 * abs(hi), 1e-3)
        fig.update_yaxes(range=[lo - pad, hi + pad])


#: The sites of the Figure-1 view (:func:`site_norms_figure`), in forward order.
FIGURE_SITES = ("attn_in", "attn_out", "ffn_in", "ffn_out", "resid_post")
#: The sub-layer's own output drawn just before its residual contribution, where the scan recorded
#: it (sandwich norms: ``Architecture.own_sites()``; on other blocks the two are one tensor).
_OWN_BEFORE = {ATTN_RESIDUAL_SITE: ATTN_OWN_SITE, FFN_RESIDUAL_SITE: FFN_OWN_SITE}


def figure_sites(recorded: Sequence[str]) -> list[str]:
    """The panels of :func:`site_norms_figure` for a scan that recorded the sites ``recorded``:
    :data:`FIGURE_SITES`, with ``attn_own`` / ``ffn_own`` before ``attn_out`` / ``ffn_out`` when
    recorded (so on Gemma 2/3 one row is the attention, one the FFN, one the layer output)."""
    out: list[str] = []
    for s in FIGURE_SITES:
        own = _OWN_BEFORE.get(s)
        if own is not None and own in recorded:
            out.append(own)
        out.append(s)
    return out


def site_norms_figure(
    site_norms: Mapping[str, Mapping[str, Sequence[float]]],
    me_layer: int | None,
    model_name: str,
) -> go.Figure:
    """Figure-1 view: per-layer norm of the massive token vs the mean of the other tokens, per site.

    One panel per site of :func:`figure_sites` of the keys of ``site_norms`` (three per row); each
    trace carries its site in ``meta``. On a sandwich-norm model the panels of ``attn_out`` /
    ``ffn_out`` are titled as residual contributions (:func:`site_title`).
    """
    sites = figure_sites(list(site_norms))
    cols = 3
    rows = (len(sites) + cols - 1) // cols
    fig = make_subplots(
        rows=rows,
        cols=cols,
        subplot_titles=[site_title(s, sites) for s in sites],
        horizontal_spacing=0.07,
        vertical_spacing=0.14,
    )
    for i, s in enumerate(sites):
        r, c = i // cols + 1, i % cols + 1
        for key, color, label in (
            ("massive", "firebrick", "massive token"),
            ("others", "steelblue", "mean of other tokens"),
        ):
            ys = list(site_norms[s][key])
            fig.add_trace(
                go.Scatter(
                    x=list(range(len(ys))),
                    y=ys,
                    mode="lines+markers",
                    marker_size=4,
                    line_color=color,
                    name=label,
                    legendgroup=key,
                    showlegend=i == 0,
                    meta=s,
                    hovertemplate="layer %{x}: ‖h‖ = %{y:.4g}<extra>" + label + "</extra>",
                ),
                row=r,
                col=c,
            )
        fig.update_yaxes(type="log", title_text="L2 norm" if c == 1 else None, row=r, col=c)
        fig.update_xaxes(title_text="layer (0-based)", row=r, col=c)
        if me_layer is not None:
            fig.add_vline(x=me_layer, line_dash="dash", line_color="gray", row=r, col=c)
    me = "none found" if me_layer is None else f"{me_layer} (0-based) / {me_layer + 1} (1-based)"
    fig.update_layout(
        title=f"Token norms per layer — {model_name}<br><sup>median over prompts; dashed line: ME layer {me}</sup>",
        template="plotly_white",
        height=330 * rows + 120,
    )
    return fig


def token_dim_heatmap(
    values: Sequence[Sequence[float]],
    token_labels: Sequence[str],
    title: str,
) -> go.Figure:
    """|activation| per token (rows) × hidden dimension (columns)."""
    labels = [f"{i}: {t!r}" for i, t in enumerate(token_labels)]
    fig = go.Figure(
        go.Heatmap(
            z=[[abs(v) for v in row] for row in values],
            y=labels,
            colorscale="Viridis",
            colorbar_title="|a|",
            hovertemplate="token %{y}<br>dim %{x}<br>|a| = %{z:.4g}<extra></extra>",
        )
    )
    fig.update_layout(
        title=title,
        xaxis_title="hidden dimension",
        yaxis_title="token (position: text)",
        yaxis_autorange="reversed",
        template="plotly_white",
        height=max(300, 24 * len(labels) + 150),
    )
    return fig


def neuron_shares(neurons: Sequence[int], shares: Sequence[float], title: str) -> go.Figure:
    """A bar per FFN neuron: its share of the massive token's FFN output (in %)."""
    fig = go.Figure(
        go.Bar(
            x=[f"n{n}" for n in neurons],
            y=[100 * s for s in shares],
            hovertemplate="neuron %{x}: %{y:.3g} % of the FFN output<extra></extra>",
        )
    )
    fig.update_layout(
        title=title,
        xaxis_title="FFN neuron (index in d_mlp)",
        yaxis_title="share of the FFN output (%; signed projection, all neurons sum to 100)",
        template="plotly_white",
    )
    return fig


def sorted_gains(
    gain: Sequence[float], marks: Sequence[tuple[int, int, float]], k: int, title: str
) -> go.Figure:
    """``|w|`` sorted (log scale), with ``marks`` ``(dim, rank, |w|)`` and the line at ``K``."""
    absg = [abs(x) for x in gain]
    order = sorted(range(len(absg)), key=lambda i: -absg[i])
    fig = go.Figure(
        go.Scatter(
            x=list(range(1, len(absg) + 1)),
            y=[absg[i] for i in order],
            mode="lines",
            name="|w| sorted",
            customdata=order,
            hovertemplate="rank %{x}: dim %{customdata}, |w| = %{y:.3g}<extra></extra>",
        )
    )
    for dim, rank, value in marks:
        fig.add_trace(
            go.Scatter(
                x=[rank],
                y=[value],
                mode="markers+text",
                marker=dict(size=11, color="firebrick"),
                text=[f"massive dim {dim}"],
                textposition="top center",
                name=f"massive dim {dim} (rank {rank})",
            )
        )
    fig.add_vline(x=k, line_dash="dot", line_color="gray", annotation_text=f"K = {k}")
    fig.update_layout(
        title=title,
        xaxis_title="rank of |w| (1 = largest)",
        yaxis_title="|w| (gain, log scale)",
        yaxis_type="log",
        template="plotly_white",
    )
    return fig


def heatmap_menu(
    panels: Mapping[str, Any],
    title: str,
    xaxis_title: str,
    yaxis_title: str,
    colorbar_title: str = "",
) -> go.Figure:
    """One heatmap per panel (label: ``z``, an array or nested lists ``[row col]``), the first
    shown, a drop-down menu to switch; NaN cells are left empty on a light grey background (e.g.
    the pads of a left-padded row)."""
    fig = go.Figure()
    for i, z in enumerate(panels.values()):
        fig.add_trace(go.Heatmap(z=z, visible=i == 0, colorbar={"title": colorbar_title}))
    show = [[j == i for j in range(len(panels))] for i in range(len(panels))]
    buttons = [
        {"label": k, "method": "update", "args": [{"visible": v}]} for k, v in zip(panels, show)
    ]
    fig.update_layout(
        title=title,
        xaxis_title=xaxis_title,
        yaxis_title=yaxis_title,
        template="plotly_white",
        plot_bgcolor="lightgrey",
        updatemenus=[{"buttons": buttons}],
    )
    return fig


def counts_bar(
    counts: Mapping[str, int], title: str, xaxis_title: str, yaxis_title: str
) -> go.Figure:
    """A bar per key of ``counts``, in the mapping's order."""
    fig = go.Figure(go.Bar(x=list(counts), y=list(counts.values())))
    fig.update_layout(
        title=title, xaxis_title=xaxis_title, yaxis_title=yaxis_title, template="plotly_white"
    )
    return fig


def grouped_bars(
    x: Sequence[str], series: Mapping[str, Sequence[float]], title: str, yaxis_title: str
) -> go.Figure:
    """One bar per ``x`` for each named series (grouped), on a log y axis (ratios, perplexities)."""
    fig = go.Figure([go.Bar(x=list(x), y=list(ys), name=name) for name, ys in series.items()])
    fig.update_layout(
        title=title,
        yaxis_type="log",
        yaxis_title=yaxis_title,
        barmode="group",
        template="plotly_white",
    )
    return fig


def log_heatmap(
    z: Sequence[Sequence[float]], title: str, xaxis_title: str, yaxis_title: str, hover: str
) -> go.Figure:
    """A heatmap of ``log10 z`` (rows on y, columns on x, both 0-based indices) whose hover shows
    ``z`` itself (``hover``: the hovertemplate, reading ``%{customdata}``)."""
    logz = [[math.log10(max(v, 1e-12)) for v in row] for row in z]
    fig = go.Figure(
        go.Heatmap(
            z=logz,
            customdata=[list(row) for row in z],
            colorscale="Magma",
            colorbar_title="log10",
            hovertemplate=hover + "<extra></extra>",
        )
    )
    fig.update_layout(
        title=title, xaxis_title=xaxis_title, yaxis_title=yaxis_title, template="plotly_white"
    )
    return fig


def quartile_lines(
    xs: Sequence[int], series: Mapping[str, Any], title: str, xaxis_title: str, yaxis_title: str
) -> go.Figure:
    """Per named ``[sample][x]`` series (array-like), its median over samples with the interquartile range as
    error bars, on a log y axis."""
    fig = go.Figure()
    for name, vals in series.items():
        q1, q2, q3 = np.quantile(np.asarray(vals, dtype=float), [0.25, 0.5, 0.75], axis=0)
        fig.add_trace(
            go.Scatter(
                x=list(xs), y=q2.tolist(), mode="lines+markers", name=name,
                error_y={"type": "data", "symmetric": False, "array": (q3 - q2).tolist(),
                         "arrayminus": (q2 - q1).tolist()},
                hovertemplate="%{x}: %{y:.4g}<extra>" + name + "</extra>",
            )
        )  # fmt: skip
    fig.update_yaxes(type="log")
    fig.update_layout(
        title=title, xaxis_title=xaxis_title, yaxis_title=yaxis_title, template="plotly_white"
    )
    return fig


def layer_grid(
    series: Mapping[str, tuple[Sequence[float], int | None]], title: str, yaxis_title: str
) -> go.Figure:
    """One subplot per named series (its own layer axis, up to 4 side by side, log y): the values
    per layer, and its ME layer (``None``: none) as a dashed line."""
    cols = min(len(series), 4)
    n_rows = (len(series) + cols - 1) // cols
    titles = [
        f"{n}<br><sup>ME layer {'none' if m is None else m}</sup>" for n, (_, m) in series.items()
    ]
    fig = make_subplots(n_rows, cols, subplot_titles=titles, horizontal_spacing=0.06,
                        vertical_spacing=0.18)  # fmt: skip
    for i, (name, (ys, me)) in enumerate(series.items()):
        at = {"row": i // cols + 1, "col": i % cols + 1}
        xs = list(range(len(ys)))
        hover = "layer %{x} (1-based %{customdata}): %{y:.4g}<extra>" + name + "</extra>"
        fig.add_trace(
            go.Scatter(x=xs, y=list(ys), mode="lines+markers", marker_size=4, name=name,
                       line_color="firebrick", showlegend=False, customdata=[x + 1 for x in xs],
                       hovertemplate=hover),
            **at,
        )  # fmt: skip
        fig.update_yaxes(type="log", title_text=yaxis_title if at["col"] == 1 else None, **at)
        fig.update_xaxes(title_text="layer (0-based)", **at)
        if me is not None:
            fig.add_vline(x=me, line_dash="dash", line_color="gray", **at)
    fig.update_layout(title=title, template="plotly_white", height=340 * n_rows + 120,
                      width=max(900, 330 * cols))  # fmt: skip
    return fig


def layer_panels(
    panels: Mapping[str, Mapping[str, Sequence[float]]],
    title: str,
    me_layer: int | None = None,
    colors: Sequence[str] = (),
    hline: float | None = None,
) -> go.Figure:
    """Panels side by side, one per key of ``panels`` (its title), each with one line per named
    series over layers on a log axis (a series keeps its colour, ``colors[i]``, and one legend
    entry across panels); ``hline``: a dotted line at that value in every panel."""
    fig = make_subplots(rows=1, cols=len(panels), subplot_titles=list(panels))
    for col, series in enumerate(panels.values(), 1):
        for i, (name, ys) in enumerate(series.items()):
            line = go.Scatter(
                x=list(range(len(ys))),
                y=list(ys),
                mode="lines+markers",
                name=name,
                legendgroup=name,
                showlegend=col == 1,
                line_color=colors[i] if i < len(colors) else None,
            )
            fig.add_trace(line, row=1, col=col)
        if hline is not None:
            fig.add_hline(y=hline, line_dash="dot", line_color="black", row=1, col=col)
        fig.update_yaxes(type="log", row=1, col=col)
        fig.update_xaxes(title_text="layer (0-based)", row=1, col=col)
    fig.update_layout(title=title, template="plotly_white", margin={"t": 130})
    return mark_layer(fig, me_layer)


def bars(
    values: Mapping[str, float],
    title: str,
    yaxis_title: str,
    reference: float | None = None,
    colors: Sequence[str] | None = None,
    points: Mapping[str, Sequence[float]] | None = None,
    **layout,
) -> go.Figure:
    """One bar per named value on a log axis; ``points`` (name → values): markers in a column of
    their own (e.g. each seed of a control); ``reference``: a dashed gray line (no annotation: on a
    log axis plotly reads an annotation's y as log10(y)); ``layout``: more ``update_layout``."""
    bar = go.Bar(x=list(values), y=list(values.values()), marker_color=colors, showlegend=False)
    fig = go.Figure(bar)
    for name, ys in (points or {}).items():
        fig.add_trace(go.Scatter(x=[name] * len(ys), y=list(ys), mode="markers", name=name))
    if reference is not None:
        fig.add_hline(y=reference, line_dash="dash", line_color="gray")
    fig.update_layout(
        title=title, yaxis_title=yaxis_title, yaxis_type="log", template="plotly_white", **layout
    )
    return fig


def lines(
    series: Mapping[str, tuple[Sequence[int | float], Sequence[float]]],
    title: str,
    xaxis_title: str,
    yaxis_title: str,
    reference: float | None = None,
    markers_only: Collection[str] = (),
    log_x: bool = False,
) -> go.Figure:
    """One line per named ``(xs, ys)`` series on a log y axis (``markers_only``: those as open
    markers, e.g. the seeds of a control); ``reference``: a dashed gray line, as :func:`bars`."""
    fig = go.Figure()
    for name, (xs, ys) in series.items():
        dots = name in markers_only
        mode, symbol = ("markers", "circle-open") if dots else ("lines+markers", "circle")
        fig.add_trace(
            go.Scatter(x=list(xs), y=list(ys), name=name, mode=mode, marker_symbol=symbol)
        )
    if reference is not None:
        fig.add_hline(y=reference, line_dash="dash", line_color="gray")
    fig.update_layout(title=title, xaxis_title=xaxis_title, yaxis_title=yaxis_title)
    fig.update_layout(
        yaxis_type="log", xaxis_type="log" if log_x else None, template="plotly_white"
    )
    return fig


SELECTION_STYLES = {  # no line hides another where they coincide
    "weight": ("firebrick", "solid", "circle"),
    "activation": ("darkorange", "dash", "diamond-open"),
    "random": ("gray", "dot", "square-open"),
    "magnitude": ("steelblue", "dashdot", "x"),
}
"""One colour, dash and marker per WeMask dim selection (``me_interp.interventions.wemask``)."""


def panel_lines(
    panels: Mapping[str, Mapping[str, Sequence[tuple[float, float]]]],
    xaxis_title: str,
    title: str,
    log_panels: Collection[str] = (),
    styles: Mapping[str, tuple[str | None, str, str]] = SELECTION_STYLES,
) -> go.Figure:
    """One panel per key of ``panels`` (its title), three to a row, each with one line per named
    series of ``(x, y)`` points (a series keeps its colour, dash and marker, ``styles``, and one
    legend entry across panels); ``log_panels``: the panels on a log y axis."""
    cols, nrows = 3, (len(panels) + 2) // 3
    fig = make_subplots(rows=nrows, cols=cols, subplot_titles=list(panels))
    for i, (name, series) in enumerate(panels.items()):
        at = {"row": i // cols + 1, "col": i % cols + 1}
        for v, points in series.items():
            x, y = zip(*points) if points else ((), ())
            color, dash, symbol = styles.get(v, (None, "solid", "circle"))
            fig.add_trace(
                go.Scatter(
                    x=x,
                    y=y,
                    mode="lines+markers",
                    name=v,
                    legendgroup=v,
                    showlegend=i == 0,
                    line={"color": color, "dash": dash},
                    marker={"symbol": symbol, "size": 8},
                ),
                **at,
            )
        fig.update_xaxes(title_text=xaxis_title, **at)
        if name in log_panels:
            fig.update_yaxes(type="log", **at)
    fig.update_layout(title=title, template="plotly_white", height=330 * nrows + 120)
    return fig


def cells_heatmap(cells: Cells, grid: np.ndarray, tokens: list[str], title: str) -> go.Figure:
    """The normalised ``grid`` of one patching sweep (``me_interp.patching.cells.Cells``): layer ×
    position, layer × head, or (layer, head) × position (``tokens`` label the positions)."""
    pos_labels = None
    if cells.positions is not None:
        pos_labels = [f"{p}: {tokens[p]!r}" if p < len(tokens) else str(p) for p in cells.positions]
    if cells.heads is None:  # [layer pos]
        z, x, y, xt, yt = grid.T, cells.layers, pos_labels, "layer (0-based)", "position"
    elif cells.positions is None:  # [layer head]
        z, x, y = grid.T, cells.layers, [f"head {h}" for h in cells.heads]
        xt, yt = "layer (0-based)", "head (all positions patched)"
    else:  # [layer pos head] -> rows (layer, head), columns positions
        z = grid.transpose(0, 2, 1).reshape(-1, grid.shape[1])
        y = [f"L{ly} h{h}" for ly in cells.layers for h in cells.heads]
        x, xt, yt = pos_labels, "position", "layer, head"
    fig = go.Figure(
        go.Heatmap(
            z=np.where(np.isfinite(z), z, None).tolist(),
            x=x,
            y=y,
            zmid=0,
            colorscale="RdBu",
            reversescale=True,
            colorbar={"title": "normalised"},
            hovertemplate="%{x}<br>%{y}<br>normalised %{z:.3f}<extra>" + cells.site + "</extra>",
        )
    )
    fig.update_yaxes(title_text=yt, autorange="reversed")
    fig.update_xaxes(title_text=xt)
    height = max(380, min(1600, 18 * len(y or []) + 200))
    fig.update_layout(title=title, template="plotly_white", height=height)
    return fig


def sink_heads(sh: SinkHeads, subtitle: str) -> go.Figure:
    """The sink-heads measurement (``me_interp.patching.sinkheads.SinkHeads``), layer × head: each
    head's clean attention to ``p`` (mean over the selection prompts) and its own restore (patched
    alone), the sink heads marked."""
    title = (
        "Sink heads: attention to the massive token and restore of the output (KL), per head — "
        f"{subtitle.removesuffix('</sup>')}; the {sh.k} sink heads (red) patched together restore "
        f"{sh.restore(sh.kl_top):.3g}, random non-sink heads "
        f"{np.mean(sh.random_restores() or [np.nan]):.3g}</sup>"
    )
    panels = [("attention to p (selection prompts)", sh.selection_attention().T, 0.0, 1.0)]
    if sh.single is not None:
        single = np.asarray(sh.single, dtype=np.float64).T
        # symmetric around 0 at the largest |restore| (single heads restore little: a ±1 scale
        # would show a blank panel), never narrower than ±0.05
        top = float(np.nanmax(np.abs(single), initial=0.0))
        top = max(top if np.isfinite(top) else 1.0, 0.05)
        panels.append(("restore, head alone (attribution estimate)", single, -top, top))
    fig = make_subplots(
        rows=1, cols=len(panels), subplot_titles=[p[0] for p in panels], shared_yaxes=True
    )
    for i, (name, z, lo, hi) in enumerate(panels):
        fig.add_trace(
            go.Heatmap(
                z=z.tolist(),
                x=sh.layers,
                y=list(range(sh.n_heads)),
                zmin=lo,
                zmax=hi,
                colorscale="Viridis" if i == 0 else "RdBu",
                reversescale=i > 0,
                colorbar={"x": 0.46 if len(panels) > 1 and i == 0 else 1.02, "len": 0.9},
                hovertemplate="layer %{x}<br>head %{y}<br>%{z:.3f}<extra>" + name + "</extra>",
            ),
            row=1,
            col=i + 1,
        )
        fig.add_trace(
            go.Scatter(
                x=[la for la, _ in sh.top],
                y=[h for _, h in sh.top],
                mode="markers",
                marker={"symbol": "square-open", "size": 14, "color": "red", "line": {"width": 2}},
                name="sink heads (chosen on the selection prompts)",
                showlegend=i == 0,
            ),
            row=1,
            col=i + 1,
        )
        fig.update_xaxes(title_text="layer (0-based)", row=1, col=i + 1)
    fig.update_yaxes(title_text="head", autorange="reversed", row=1, col=1)
    fig.update_layout(
        title=title,
        template="plotly_white",
        height=max(380, 22 * sh.n_heads + 220),
        legend={"orientation": "h", "y": -0.2},
    )
    return fig


# ------------------------------------------------------------------------------------------
# every written figure: room for its title, full labels on log axes
# ------------------------------------------------------------------------------------------

LINE_PX = 22
"""The height of one title line (plotly's default 17 px font and its line spacing)."""
TITLE_WIDTH = 90
"""A title's first line is wrapped at this many characters (on spaces, with ``<br>``)."""


def tidy(fig: go.Figure) -> go.Figure:
    """Lay ``fig`` out so that nothing overlaps and every axis reads alone; applied to every figure
    an experiment writes (``study.execute``), in place, and returned.

    * The title's first line is wrapped at :data:`TITLE_WIDTH` characters and the top margin fits
      its lines above the subplot titles of the top row (plotly's default margin fits one line: a
      ``<sup>`` subtitle ran into the subplot titles).
    * A log axis labels every tick with its full value (``tickformat``: plotly's own minor labels
      are the bare digits ``2 5 2 5``, without their magnitude).
    * Subplots sharing a y axis still label each panel's ticks.
    """
    lay = fig.layout
    text = lay.title.text if lay.title is not None else None
    if text:  # plotly does not wrap a title: a long first line ran off the figure
        first, sep, rest = str(text).partition("<br>")
        wrapped = textwrap.wrap(first, TITLE_WIDTH, break_long_words=False) or [first]
        text = "<br>".join(wrapped) + sep + rest
        fig.update_layout(title_text=text)
    n_title = 0 if not text else str(text).count("<br>") + 1
    has_subtitles = any(
        a.yref == "paper" and a.yanchor == "bottom" and a.xref == "paper" and a.showarrow is False
        for a in lay.annotations or ()
    )
    # plotly centres the title in the top margin: the margin fits its lines and, on either side,
    # the room the subplot titles of the top row take below it
    below = LINE_PX + 10 if has_subtitles else 10
    top = 2 * below + LINE_PX * n_title + 10
    if top > (lay.margin.t if lay.margin.t is not None else 100):  # plotly's default: 100 px
        fig.update_layout(margin_t=top)
    for ax in [*fig.select_xaxes(), *fig.select_yaxes()]:
        if ax.type == "log" and ax.tickformat is None:
            ax.update(tickformat="~g")
    if any(ax.matches is not None for ax in fig.select_yaxes()):
        fig.update_yaxes(showticklabels=True)
    return fig


def outcome_heatmap(
    me_after: Sequence[Sequence[int | None]],
    columns: Sequence[int],
    parts: Sequence[str],
    hover: str,
    customdata: Sequence[Sequence[float]] | None = None,
) -> go.Figure:
    """The ME layer located after each (part, layer) edit: one cell per part (rows) and layer
    (columns), its number written in it (``none`` and -1 where no layer is massive)."""
    return go.Figure(
        go.Heatmap(
            z=[[-1 if v is None else v for v in row] for row in me_after],
            x=[str(c) for c in columns],
            y=list(parts),
            text=[["none" if v is None else str(v) for v in row] for row in me_after],
            texttemplate="%{text}",
            customdata=customdata,
            colorscale="Viridis",
            zmin=-1,
            colorbar_title="ME layer<br>(-1: none)",
            hovertemplate=hover + "<extra></extra>",
        )
    )


def interval_bars(
    labels: Sequence[str],
    estimates: Sequence[tuple[float, float, float]],
    texts: Sequence[str],
    hover: str,
) -> go.Figure:
    """One bar per label at ``value`` with its interval ``(value, lo, hi)`` as error bars."""
    return go.Figure(
        go.Bar(
            x=list(labels),
            y=[v for v, _, _ in estimates],
            error_y={
                "type": "data",
                "symmetric": False,
                "array": [hi - v for v, _, hi in estimates],
                "arrayminus": [v - lo for v, lo, _ in estimates],
            },
            text=list(texts),
            hovertemplate=hover + "<extra></extra>",
        )
    )


def layer_head_heatmap(
    z: Sequence[Sequence[float]], title: str, cbar: str, me_layer: int | None, **kw: Any
) -> go.Figure:
    """A heatmap of ``z[layer][head]`` (heads on y, layers on x), the ME layer marked; ``kw``: more
    ``go.Heatmap`` arguments (``zmin``, ``colorscale``, ...)."""
    fig = go.Figure(
        go.Heatmap(
            z=[list(r) for r in zip(*z)],  # heads on y, layers on x
            x=list(range(len(z))),
            y=list(range(len(z[0]) if z else 0)),
            colorbar_title=cbar,
            hovertemplate="layer %{x}, head %{y}: %{z:.3g}<extra></extra>",
            **kw,
        )
    )
    fig.update_layout(
        title=title, xaxis_title="layer (0-based)", yaxis_title="head", template="plotly_white"
    )
    return mark_layer(fig, me_layer)


def layer_layer_heatmap(z: Sequence[Sequence[float]], title: str) -> go.Figure:
    """A heatmap of the cosines ``z[layer][layer]`` between layers (from −1 to 1)."""
    n = len(z)
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=list(range(n)),
            y=list(range(n)),
            zmin=-1,
            zmax=1,
            colorscale="RdBu",
            colorbar_title="cos",
            hovertemplate="layer %{y} vs layer %{x}: cos %{z:.4f}<extra></extra>",
        )
    )
    fig.update_layout(
        title=title,
        xaxis_title="layer (0-based)",
        yaxis_title="layer (0-based)",
        template="plotly_white",
    )
    return fig
