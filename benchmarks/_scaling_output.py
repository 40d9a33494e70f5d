"""The tables and the figure of ``bench_scaling.py`` from its measured curves.

:func:`tables` gives the markdown (the fitted exponents, one table per curve with the ratios to its
first point, the scan's memory as the layers grow); :func:`svg` a standalone SVG of log-log panels of
seconds against each varied quantity and the scan's memory above the weights against the layers
(plotly's PNG export needs kaleido and matplotlib is not a dependency, so the SVG is written here).
"""

from __future__ import annotations

import math

from _sections import table

BENCHES = ("scan", "patching", "battery")
VARIES = ("prompts", "tokens", "layers", "width")


def _f(v: float | None, fmt: str = ".2f") -> str:
    return "—" if v is None else format(v, fmt)


def tables(curves: list[dict], mem: dict | None) -> str:
    parts = [
        "Fitted growth exponents (least-squares slope of log cost on log x):\n",
        table(
            [
                "bench",
                "varies",
                "x",
                "held",
                "CPU-time exponent",
                "wall exponent",
                "added-memory exponent",
            ],
            [
                [
                    c["bench"],
                    c["vary"],
                    f"{c['points'][0]['x']} → {c['points'][-1]['x']}",
                    ", ".join(f"{k} {v}" for k, v in c["base"].items() if _held(c, k)),
                    _f(c["cpu_time_exponent"]),
                    _f(c["time_exponent"]),
                    _f(c["added_memory_exponent"]),
                ]
                for c in curves
            ],
            "llllrrr",
        ),
    ]
    for c in curves:
        t0 = c["points"][0]["cpu_seconds"]
        x0 = c["points"][0]["x"]
        rows = [
            [
                p["x"],
                f"{p['x'] / x0:g}",
                f"{p['params'] / 1e6:.1f}",
                f"{p['cpu_seconds']:.3f}",
                f"{p['cpu_seconds'] / t0:.2f}",
                f"{p['seconds']:.3f}",
                f"{p['peak_rss_mib']:.0f}",
                f"{p['added_mib']:.0f}",
                f"{p['full_cache_mib']:.0f}" if "full_cache_mib" in p else "—",
            ]
            for p in c["points"]
        ]
        parts.append(
            f"\n**{c['bench']}, varying {c['vary']}** (CPU-time exponent "
            f"{_f(c['cpu_time_exponent'])}, wall {_f(c['time_exponent'])}):\n"
        )
        parts.append(
            table(
                [
                    c["vary"],
                    "x / x₀",
                    "params (M)",
                    "CPU s",
                    "CPU / CPU₀",
                    "wall s",
                    "peak RSS (MiB)",
                    "added (MiB)",
                    "full cache (MiB)",
                ],
                rows,
            )
        )
    if mem:
        parts.append(
            "\n**The scan's memory as the layers grow** (d_model as in the layers curve):\n"
        )
        parts.append(
            table(
                ["layers", "weights (MiB)", "peak − weights (MiB)", "added (MiB)"],
                [
                    [x, f"{w:.0f}", f"{a:.0f}", f"{ad:.0f}"]
                    for x, w, a, ad in zip(
                        mem["layers"],
                        mem["weight_mib"],
                        mem["above_weights_mib"],
                        mem["added_mib"],
                        strict=True,
                    )
                ],
            )
        )
        parts.append(
            f"\nSlopes (MiB per layer): peak − weights {_f(mem['slope_above_weights_mib_per_layer'])}, "
            f"added {_f(mem['slope_added_mib_per_layer'])}; the weights {_f(mem['weight_mib_per_layer'], '.1f')}; "
            f"the recorder's statistics {_f(mem['statistics_mib_per_layer'], '.3f')}."
        )
    return "\n".join(parts) + "\n"


def _held(c: dict, key: str) -> bool:
    varied = {"layers": "n_layers", "width": "d_model"}.get(c["vary"], c["vary"])
    return key != varied


COLORS = {"scan": "#1f77b4", "patching": "#d62728", "battery": "#2ca02c"}


def svg(curves: list[dict], mem: dict | None) -> str:
    """Log-log panels of seconds against each varied quantity (one line per bench), and the scan's
    memory above the weights against the layers (linear), as a standalone SVG."""
    W, H, pad = 300, 230, 45
    panels = [(v, [c for c in curves if c["vary"] == v]) for v in VARIES]
    n = len(panels) + (1 if mem else 0)
    cols = 3
    rows_n = -(-n // cols)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{cols * W}" height="{rows_n * H + 30}" '
        'font-family="sans-serif" font-size="11">',
        '<rect width="100%" height="100%" fill="white"/>',
    ]
    for legend_i, b in enumerate(BENCHES):
        out.append(
            f'<rect x="{10 + legend_i * 110}" y="{rows_n * H + 10}" width="12" height="12" '
            f'fill="{COLORS[b]}"/><text x="{26 + legend_i * 110}" y="{rows_n * H + 20}">{b}</text>'
        )
    series_sets = []
    for vary, cs in panels:
        series_sets.append(
            (
                f"CPU seconds vs {vary} (log-log)",
                [(c["bench"], [(p["x"], p["cpu_seconds"]) for p in c["points"]]) for c in cs],
                True,
                "exponents: " + ", ".join(f"{c['bench']} {_f(c['cpu_time_exponent'])}" for c in cs),
            )
        )
    if mem:
        series_sets.append(
            (
                "scan: peak RSS − weights (MiB) vs layers",
                [("scan", list(zip(mem["layers"], mem["above_weights_mib"], strict=True)))],
                False,
                f"slope {_f(mem['slope_above_weights_mib_per_layer'])} MiB/layer; weights "
                f"{_f(mem['weight_mib_per_layer'], '.0f')} MiB/layer",
            )
        )
    for i, (title, series, log, note) in enumerate(series_sets):
        ox, oy = (i % cols) * W, (i // cols) * H
        pts = [pt for _, s in series for pt in s if pt[1] and pt[1] > 0]
        out.append(f'<text x="{ox + pad}" y="{oy + 15}" font-weight="bold">{title}</text>')
        out.append(f'<text x="{ox + pad + 4}" y="{oy + 38}" font-size="10">{note}</text>')
        if not pts:
            continue
        f = (lambda v: math.log10(v)) if log else (lambda v: v)
        xs, ys = [f(p[0]) for p in pts], [f(p[1]) for p in pts]
        x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
        if not log:
            y0 = min(0.0, y0)
        x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1)
        w, h = W - pad - 10, H - pad - 25

        def px(v, x0=x0, x1=x1, ox=ox, w=w):
            return ox + pad + (v - x0) / (x1 - x0) * w

        def py(v, y0=y0, y1=y1, oy=oy, h=h):
            return oy + 25 + h - (v - y0) / (y1 - y0) * h

        out.append(
            f'<rect x="{ox + pad}" y="{oy + 25}" width="{w}" height="{h}" fill="none" stroke="#999"/>'
        )
        for v, lab in ((y0, _tick(y0, log)), (y1, _tick(y1, log))):
            out.append(f'<text x="{ox + 2}" y="{py(v) + 4:.1f}">{lab}</text>')
        for v, lab in ((x0, _tick(x0, log)), (x1, _tick(x1, log))):
            out.append(f'<text x="{px(v) - 10:.1f}" y="{oy + 25 + h + 14}">{lab}</text>')
        for bench, s in series:
            s = [(f(a), f(b)) for a, b in s if b and b > 0]
            if not s:
                continue
            path = " ".join(f"{px(a):.1f},{py(b):.1f}" for a, b in s)
            out.append(
                f'<polyline points="{path}" fill="none" stroke="{COLORS[bench]}" stroke-width="2"/>'
            )
            out.extend(
                f'<circle cx="{px(a):.1f}" cy="{py(b):.1f}" r="3" fill="{COLORS[bench]}"/>'
                for a, b in s
            )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _tick(v: float, log: bool) -> str:
    return f"{10**v:.3g}" if log else f"{v:.0f}"
