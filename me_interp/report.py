"""The report: renders a battery's state (``battery.json``) as HTML and Markdown; runs nothing.

:func:`write_report` writes ``<out>/report.html``: a model card, each claim of the paper with the
measured verdict beside the figure behind it (drawn inline by one local plotly.js), and links to every
figure file; :func:`verdicts_markdown` writes ``<out>/report.md``. The battery
(:mod:`me_interp.battery`) calls it after every experiment; ``me-interp report OUT`` rebuilds it.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from me_interp import claims as claims_mod
from me_interp import io, terminal
from me_interp.probes.massive import site_text
from me_interp.study import Experiment

NOT_APPLICABLE = claims_mod.NOT_APPLICABLE
FINISHED = ("done", NOT_APPLICABLE)
"""Battery statuses of an experiment that ran to the end (and is skipped on resume)."""
STATE_FILE = "battery.json"
REPORT_FILE = "report.html"
SUMMARY_FILE = "report.md"


_COLOR = {
    claims_mod.HOLDS: "#1a7f37",
    claims_mod.FAILS: "#cf222e",
    claims_mod.INCONCLUSIVE: "#9a6700",
    claims_mod.NOT_APPLICABLE: "#57606a",
}

TOP_FIGURE = ("me_layer", "norms_by_site")
"""The figure the report opens with (experiment, figure stem): Figure 1, norms by site."""
MAX_INLINE_BYTES = 1_500_000
"""A figure whose plotly JSON is larger is linked, not embedded (keeps report.html small)."""


def key_figures(exp: Experiment, available: Sequence[str]) -> list[str]:
    """The figures of experiment ``exp`` to show inline (its ``key_figures``), among the
    ``available`` ones; its first figure when it names none of them."""
    chosen = [f for f in exp.key_figures if f in available]
    return chosen or list(available[:1])


KIND_LABEL = claims_mod.KIND_LABEL


def _verdict_badge(c: claims_mod.Claim, adjusted: dict[str, str] | None = None) -> str:
    label = KIND_LABEL[c.kind]
    extra = f" <small>({label})</small>" if label else ""
    if c.implied_by:  # a corollary: shown beside the claim it restates, never counted
        extra += (
            f" <small>(corollary of <code>{html.escape(c.implied_by)}</code>; not counted)</small>"
        )
    holm = (adjusted or {}).get(c.id, c.verdict)
    if holm != c.verdict:
        extra += f" <small>(Holm-adjusted: {holm})</small>"
    return f"<span class=verdict style='color:{_COLOR[c.verdict]}'>{c.verdict}</span>{extra}"


def _placebo_html(c: claims_mod.Claim) -> str:
    """The placebo layers of a claim, beside it: a one-line summary and a small inline curve (the
    statistic per layer, the ME layer's point red, the bound the rule asks it to beat dashed)."""
    pl = c.placebo
    if pl is None:
        return ""
    pts = [(la, v) for la, v in zip(pl.layers, pl.values, strict=True) if v == v]
    if len(pts) < 2:
        return f"<br><small>{html.escape(pl.text())}</small>"
    w, h = 160, 36
    xs = [la for la, _ in pts]
    vs = [v for _, v in pts] + ([pl.bound] if pl.bound == pl.bound else [])
    lo, hi = min(vs), max(vs)

    def xy(la: int, v: float) -> tuple[float, float]:
        x = (la - xs[0]) / max(xs[-1] - xs[0], 1) * (w - 4) + 2
        return x, h - 2 - (v - lo) / ((hi - lo) or 1.0) * (h - 4)

    line = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(la, v) for la, v in pts))
    mx, my = xy(pl.layer, pl.value) if pl.value == pl.value else (0.0, 0.0)
    bound = ""
    if pl.bound == pl.bound:
        _, by = xy(xs[0], pl.bound)
        bound = f"<line x1=0 x2={w} y1={by:.1f} y2={by:.1f} stroke='#999' stroke-dasharray='3,2'/>"
    svg = (
        f"<svg width={w} height={h} style='vertical-align:middle'>{bound}"
        f"<polyline points='{line}' fill=none stroke='#57606a'/>"
        f"<circle cx={mx:.1f} cy={my:.1f} r=3 fill='#cf222e'/></svg>"
    )
    return f"<br>{svg} <small>{html.escape(pl.text())}</small>"


def _claim_rows(cs: Sequence[dict[str, Any]], adjusted: dict[str, str] | None = None) -> list[str]:
    rows = []
    for d in cs:
        c = claims_mod.Claim.from_dict(d)
        measured = html.escape(c.estimate.text()) if c.estimate else "&mdash;"
        apart = not c.counted
        why = f"<br><i>{html.escape(c.why)}</i>" if c.why else ""
        details = f"<br><small>{html.escape(c.details)}</small>" if c.details else ""
        details += _placebo_html(c)
        rows.append(
            f"<tr{' class=sanity' if apart else ''}>"
            f"<td>{_verdict_badge(c, adjusted)}</td>"
            f"<td><code>{html.escape(c.id)}</code><br><small>{html.escape(c.section)}</small></td>"
            f"<td>{html.escape(c.statement)}{why}</td>"
            f"<td>{html.escape(c.statistic)}: <b>{measured}</b>{details}</td>"
            f"<td><small>{html.escape(c.rule)}</small></td>"
            f"<td><small>{html.escape(c.control)}</small></td></tr>"
        )
    return rows


def _claim_lines(cs: Sequence[dict[str, Any]], adjusted: dict[str, str] | None = None) -> str:
    """The verdict lines shown beside the figure: verdict, id, statement, estimate (or the reason)."""
    items = []
    for d in cs:
        c = claims_mod.Claim.from_dict(d)
        apart = not c.counted
        if c.estimate is not None:
            measured = f"{html.escape(c.statistic)}: <b>{html.escape(c.estimate.text())}</b>"
        else:
            measured = f"<i>{html.escape(c.why)}</i>"
        measured += _placebo_html(c)
        items.append(
            f"<li{' class=sanity' if apart else ''} style='border-left-color:{_COLOR[c.verdict]}'>"
            f"{_verdict_badge(c, adjusted)} "
            f"<code>{html.escape(c.id)}</code> <small>{html.escape(c.section)}</small><br>"
            f"{html.escape(c.statement)}<br><small>{measured}</small></li>"
        )
    return f"<ul class=claims>{''.join(items)}</ul>"


def shared_definitions(cs: Sequence[dict[str, Any]]) -> tuple[list[str], list[dict[str, Any]]]:
    """The definitions an experiment's claims repeat, said once: each ``"; "``-separated part of a
    statistic that two or more of its claims share (and that is long enough to be a definition),
    and the claims with those parts taken out of their statistic."""
    parts = [str(d.get("statistic", "")).split("; ") for d in cs]
    seen: dict[str, int] = {}
    for ps in parts:
        for p in dict.fromkeys(ps):
            seen[p] = seen.get(p, 0) + 1
    shared = [p for p, k in seen.items() if k >= 2 and len(p) >= 60]
    if not shared:
        return [], list(cs)
    out = []
    for d, ps in zip(cs, parts, strict=True):
        kept = [p for p in ps if p not in shared]
        mark = " (see the definitions above)" if len(kept) < len(ps) else ""
        out.append({**d, "statistic": "; ".join(kept) + mark})
    return shared, out


def _definitions_html(defs: Sequence[str]) -> str:
    if not defs:
        return ""
    items = "".join(f"<li>{html.escape(d)}</li>" for d in defs)
    return f"<div class=defs><b>Definitions</b> (every claim below uses them)<ul>{items}</ul></div>"


WIDE_AXES = 3
"""A figure with at least this many x axes (a grid of subplots) is drawn full width below the verdict
lines instead of beside them (its subplot titles would overlap in a column)."""


TITLE_WIDTH = 80
"""Inline figures wrap the first line of their title at this many characters (a narrow column would
cut it off: plotly does not wrap titles)."""


def _wrap_title(layout: dict[str, Any]) -> None:
    """Wrap the first line of ``layout``'s title at :data:`TITLE_WIDTH` characters (on spaces, with
    ``<br>``) and make room for the added lines in the top margin."""
    import textwrap

    title = layout.get("title")
    if isinstance(title, str):
        title = layout["title"] = {"text": title}
    if not isinstance(title, dict) or not isinstance(title.get("text"), str):
        return
    before = title["text"].count("<br>")
    first, sep, rest = title["text"].partition("<br>")
    lines = textwrap.wrap(first, TITLE_WIDTH, break_long_words=False) or [first]
    title["text"] = "<br>".join(lines) + sep + rest
    added = title["text"].count("<br>") - before  # plotly centres the title in the top margin:
    margin = layout.setdefault("margin", {})  # each added line needs its height on both sides
    margin["t"] = max(int(margin.get("t") or 80) + 2 * 22 * added, 40 + 22 * (before + added + 1))


def _figure_json(path: Path) -> tuple[str, bool] | None:
    """The plotly figure at ``path`` as JSON text safe inside a script (layout width dropped so it
    fits its column) and whether it is wide (:data:`WIDE_AXES`), or ``None`` when the file is
    missing or over :data:`MAX_INLINE_BYTES`."""
    import json

    if not path.is_file() or path.stat().st_size > MAX_INLINE_BYTES:
        return None
    fig = json.loads(path.read_text(encoding="utf-8"))
    layout = fig.setdefault("layout", {})
    layout.pop("width", None)
    layout["autosize"] = True
    wide = sum(1 for k in layout if k.startswith("xaxis")) >= WIDE_AXES
    if not wide:  # a wide figure is drawn full width: its title fits as it is
        _wrap_title(layout)
    return json.dumps(fig, separators=(",", ":")).replace("</", "<\\/"), wide


def _inline_figure(run_dir: Path, rel: Path, stem: str, fig_id: str) -> tuple[str, bool]:
    """(a div that plotly.js draws from the figure's JSON with a link to the full figure file,
    whether the figure is wide)."""
    link = f"<a href='{html.escape(str(rel / (stem + '.html')))}'>{html.escape(stem)} (full figure)</a>"
    path = run_dir / f"{stem}.json"
    got = _figure_json(path)
    if got is None:
        size = path.stat().st_size if path.is_file() else 0
        why = f"too large to embed ({size / 1e6:.1f} MB)" if size else "no figure data"
        return f"<div class=figure><p><i>{why}</i>: open {link}</p></div>", False
    text, wide = got
    return (
        f"<div class=figure><div class=plot id='{fig_id}'></div>"
        f"<script type='application/json' id='{fig_id}-data'>{text}</script>"
        f"<div class=figlink>{link}</div></div>"
    ), wide


_DRAW_SCRIPT = """<script>
(function () {
  for (const el of document.querySelectorAll("div.plot")) {
    const fig = JSON.parse(document.getElementById(el.id + "-data").textContent);
    Plotly.newPlot(el, fig.data, fig.layout, {responsive: true, displaylogo: false});
  }
})();
</script>"""


def _estimate_cells(c: claims_mod.Claim) -> tuple[str, str, str]:
    """(estimate, 95% interval, n) of a claim as short text; empty where it has no estimate."""
    e = c.estimate
    if e is None:
        return "", "", ""
    interval = (
        "" if e.method == "exact" else f"[{claims_mod.fmt_num(e.lo)}, {claims_mod.fmt_num(e.hi)}]"
    )
    n = f"{e.n} {claims_mod.unit_text(e.n, e.unit)}"
    if e.n_eff is not None and e.n_eff != e.n:
        n += f" ({e.n_eff} distinct)"
    return claims_mod.fmt_num(e.value), interval, n


def _finished(state: Mapping[str, Any], name: str) -> Mapping[str, Any] | None:
    entry = state["experiments"].get(name)
    return entry if entry is not None and entry.get("status") in FINISHED else None


def claims_table(
    state: Mapping[str, Any], experiments: Sequence[str], adjusted: Mapping[str, str]
) -> str:
    """The table the page opens with: one row per claim of every experiment (experiment, claim,
    kind, verdict, estimate, interval, n), one row per experiment that failed or did not run."""
    head = "".join(
        f"<th>{h}</th>"
        for h in ("experiment", "claim", "kind", "verdict", "estimate", "95% interval", "n")
    )
    rows = []
    for name in experiments:
        entry = state["experiments"].get(name)
        link = f"<a href='#{html.escape(name)}'>{html.escape(name)}</a>"
        if _finished(state, name) is None:
            status = "not run" if entry is None else "failed"
            rows.append(f"<tr><td>{link}</td><td colspan=6><i>{status}</i></td></tr>")
            continue
        for d in entry.get("claims") or []:
            c = claims_mod.Claim.from_dict(d)
            est, interval, n = _estimate_cells(c)
            holm = adjusted.get(c.id, c.verdict)
            verdict = f"<b style='color:{_COLOR[c.verdict]}'>{c.verdict}</b>" + (
                f" <small>(Holm: {holm})</small>" if holm != c.verdict else ""
            )
            why = f"<small><i>{html.escape(c.why)}</i></small>" if not est and c.why else ""
            rows.append(
                f"<tr{' class=sanity' if c.kind != 'claim' else ''}><td>{link}</td>"
                f"<td><code>{html.escape(c.id.split('.', 1)[-1])}</code></td><td>{c.kind}</td>"
                f"<td>{verdict}</td>"
                + (
                    f"<td>{est}</td><td>{interval}</td><td>{html.escape(n)}</td>"
                    if est
                    else f"<td colspan=3>{why}</td>"
                )
                + "</tr>"
            )
    return f"<table class=claimtable><tr>{head}</tr>{''.join(rows)}</table>"


def spans_text(values: Sequence[int], show: int = 8) -> str:
    """Integers (positions) said briefly: ``"0, 3, 7"``, ``"0–99 (100)"`` for a run, else the first
    ``show`` and the count."""
    vals = sorted(set(values))
    if len(vals) <= show:
        return ", ".join(map(str, vals))
    if vals[-1] - vals[0] + 1 == len(vals):
        return f"{vals[0]}–{vals[-1]} ({len(vals)})"
    return f"{', '.join(map(str, vals[:show]))}, … ({len(vals)} in all)"


def findings(state: Mapping[str, Any], experiments: Sequence[Experiment]) -> list[str]:
    """A few plain-language lines generated from the finished runs: where the ME layer is (from the
    typed me_layer Result), then each experiment's headline claim (its first claim of kind *claim*
    that could be judged) with its verdict and estimate, and the experiments that did not apply.
    A line only for what was measured."""
    lines = []
    for exp in experiments:
        entry = _finished(state, exp.name)
        if entry is None:
            continue
        if exp.name == "me_layer" and exp.result_type is not None and entry["status"] == "done":
            run_dir = Path(entry["run_dir"])
            if (run_dir / io.RESULT_FILE).is_file():
                me = io.read_result(exp.result_type, run_dir)
                loc = me.location
                if loc.me_layer is None:
                    lines.append(
                        f"No massive activation on these {me.n_prompts} prompts: no ME layer."
                    )
                else:
                    pos = [p for ps in loc.massive_positions for p in ps]
                    lines.append(
                        f"The ME layer is {loc.me_layer} (0-based; {loc.me_layer + 1} 1-based), made "
                        f"by {site_text(str(me.me_site))}; massive dims "
                        f"{', '.join(map(str, loc.massive_dims[:4]))}"
                        + (" …" if len(loc.massive_dims) > 4 else "")
                        + (f"; positions {spans_text(pos)}" if pos else "")
                        + f"; {me.n_prompts} prompts."
                    )
                    if me.header.n_units == 1:
                        lines.append(_one_unit_line(state, experiments))
        if entry["status"] == NOT_APPLICABLE:
            lines.append(f"{exp.name}: not applicable — {entry.get('why', '')}")
            continue
        cs = [claims_mod.Claim.from_dict(d) for d in entry.get("claims") or []]
        judged = [c for c in cs if c.kind == "claim" and c.estimate is not None]
        if not judged:
            continue
        c = judged[0]
        est, interval, n = _estimate_cells(c)
        others = claims_mod.counts(judged[1:])
        rest = ", ".join(f"{k} {v}" for v, k in others.items() if k)
        lines.append(
            f"{exp.name}: {c.statement.rstrip('.')} — {c.verdict} ({est}"
            + (f" {interval}" if interval else "")
            + f", n = {n})"
            + (f"; its other claims: {rest}" if rest else "")
            + "."
        )
    return lines


def _one_unit_line(state: Mapping[str, Any], experiments: Sequence[Experiment]) -> str:
    """The finding for a battery whose prompts share one massive-token prefix (a BOS at the
    massive position): how many claims and controls rest on that one measurement, and what decides
    them."""
    n = sum(
        claims_mod.ONE_MEASUREMENT in (d.get("why") or "")
        for exp in experiments
        if (entry := _finished(state, exp.name)) is not None
        for d in entry.get("claims") or []
    )
    return (
        "Every prompt has the same massive-token prefix (one unit), so the massive token's state "
        f"is one measurement: {n} of the claims and controls about it are not decided; prompts "
        "with different first tokens (--bos no) decide them."
    )


def _run_dir(entry: dict[str, Any], out: Path) -> tuple[Path, Path]:
    """(the run directory, its path relative to ``out`` for links)."""
    run_dir = Path(entry["run_dir"])
    return run_dir, Path(_relpath(run_dir, out))


def _battery_cost(state: Mapping[str, Any], experiments: Sequence[str]) -> str | None:
    """The experiments' summed wall time and largest peak memory (battery.json), or ``None``."""
    entries = [state["experiments"].get(n) or {} for n in experiments]
    timed = [e for e in entries if e.get("seconds") is not None]
    if not timed:
        return None
    peak = max((e.get("peak_rss_mib") or 0.0) for e in timed)
    return (
        f"{terminal.fmt_seconds(sum(e['seconds'] for e in timed))} over {len(timed)} experiments "
        f"(each one's time and peak memory in its heading); largest peak RSS {peak:.0f} MiB"
    )


def _model_card(out: Path, state: dict[str, Any], experiments: Sequence[Experiment]) -> str:
    """The model, prompts and code the battery ran: ``env.json`` and the ME-layer result of a
    finished run (the first one, read back as its typed Result), the battery's settings."""
    settings = state.get("settings", {})
    env: dict[str, Any] = {}
    me: Any = None
    for exp in experiments:
        entry = state["experiments"].get(exp.name) or {}
        if entry.get("status") not in FINISHED:
            continue
        run_dir = Path(entry["run_dir"])
        if not env and (run_dir / io.ENV_FILE).is_file():
            env = io.read_json(run_dir / io.ENV_FILE)
        if exp.name == "me_layer" and exp.result_type is not None:
            if (run_dir / io.RESULT_FILE).is_file():
                me = io.read_result(exp.result_type, run_dir)
    model = env.get("model") or settings.get("model") or "bundled SmolLM2-135M-Instruct"
    bos = str(env.get("bos", settings.get("bos")))
    if me is not None:
        bos += "; every prompt starts with BOS" if me.bos_prepended else "; no BOS prepended"
    prompts = settings.get("prompts") or "built-in prompts (docs/prompts.md)"
    n = "" if me is None else f"; n = {me.n_prompts} in the ME-layer scan"
    if me is not None and me.me_layer is not None:
        found = (
            f"layer {me.me_layer} (0-based) = {me.me_layer + 1} (1-based), made by "
            f"{site_text(str(me.me_site))}; dims {me.location.massive_dims[:8]}"
        )
    elif me is not None:
        found = "none: no massive activation on these prompts"
    else:
        found = "not measured (me_layer did not run)"
    rows = [
        ("model", model),
        ("architecture", env.get("architecture")),
        ("layers", env.get("n_layers")),
        ("d_model", env.get("d_model")),
        ("dtype", settings.get("dtype_resolved", env.get("dtype"))),
        ("device", settings.get("device_resolved", env.get("device"))),
        ("BOS rule", bos),
        ("prompts", f"{prompts}{n} (each claim gives its own n)"),
        ("seed", settings.get("seed")),
        ("ME layer", found),
        ("cost", _battery_cost(state, [e.name for e in experiments])),
        (
            "me_interp",
            f"{settings.get('me_interp', env.get('me_interp'))}, commit "
            f"{settings.get('git_commit', env.get('git_commit'))}",
        ),
        (
            "libraries",
            ", ".join(
                f"{k} {env[k]}" for k in ("torch", "transformer_lens", "transformers") if env.get(k)
            )
            or None,
        ),
    ]
    body = "".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>"
        for k, v in rows
        if v is not None
    )
    return f"<table class=card><tr><th colspan=2>model card</th></tr>{body}</table>"


def write_report(out: Path, state: dict[str, Any], experiments: Sequence[Experiment]) -> Path:
    """Write ``<out>/report.html`` from the battery state, and ``<out>/report.md``.

    The page opens with the model card, the verdict counts and the ME-layer figure (Figure 1: norms
    by site); then per experiment its verdict lines beside its key figures (``Experiment.key_figures``, drawn
    inline from the figures' plotly JSON), links to every figure file, and every claim in full
    (estimate, interval, n, rule, control). It loads plotly.js from ``<out>/plotly.min.js`` (written
    if missing), so the folder opens offline by double-click.
    """
    import plotly.offline

    out = Path(out)
    js = out / io.PLOTLY_JS
    if not js.is_file():
        io.atomic_write_text(js, plotly.offline.get_plotlyjs())
    sections = []
    exps, experiments = experiments, [e.name for e in experiments]
    all_claims = finished_claims(state, experiments)
    adjusted = dict(zip((d["id"] for d in all_claims), claims_mod.holm(all_claims), strict=True))
    top_figure = ""
    for exp in exps:
        name = exp.name
        entry = state["experiments"].get(name)
        head = f"<h2 id='{name}'>{name}</h2>"
        if entry is None:
            sections.append(f"<section>{head}<p><i>not run yet</i></p></section>")
            continue
        if entry["status"] not in FINISHED:
            err = html.escape(entry.get("error", ""))
            sections.append(
                f"<section>{head}<p class=links>{html.escape(cost_text(entry))}</p>"
                f"<p style='color:#cf222e'>failed: {err}</p></section>"
            )
            continue
        defs, cs = shared_definitions(entry.get("claims") or [])
        run_dir, rel = _run_dir(entry, out)
        figs = list(entry.get("figures") or [])
        links = " &middot; ".join(
            f"<a href='{html.escape(str(rel / (f + '.html')))}'>{html.escape(f)}</a>" for f in figs
        )
        result_link = f"<a href='{html.escape(str(rel / io.RESULT_FILE))}'>result.json</a>"
        if name == TOP_FIGURE[0] and TOP_FIGURE[1] in figs:
            top_figure = _inline_figure(run_dir, rel, TOP_FIGURE[1], "fig-top")[0]
        shown = [
            _inline_figure(run_dir, rel, f, f"fig-{name}-{i}")
            for i, f in enumerate(key_figures(exp, figs))
        ]
        beside = "".join(h for h, wide in shown if not wide)
        below = "".join(h for h, wide in shown if wide)
        na = (
            f"<p><b>not applicable</b>: {html.escape(entry['why'])}</p>"
            if entry["status"] == NOT_APPLICABLE
            else ""
        )
        table = (
            "<details><summary>every claim in full: estimate, rule, control</summary>"
            "<table><tr><th>verdict</th><th>claim</th><th>statement</th><th>statistic: estimate "
            "[95% CI] (n)</th><th>rule</th><th>control</th></tr>"
            + "".join(_claim_rows(cs, adjusted))
            + "</table></details>"
            if cs
            else ""
        )
        row = (
            f"<div class=row><div class=claimcol>{_claim_lines(cs, adjusted)}</div>"
            f"<div class=figcol>{beside}</div></div>"
            if beside
            else _claim_lines(cs, adjusted)
        ) + below
        sections.append(
            f"<section>{head}<p class=links>{html.escape(cost_text(entry))} &middot; {result_link} "
            f"{('&middot; figures: ' + links) if links else ''}</p>{na}{_definitions_html(defs)}{row}"
            f"{table}</section>"
        )
    t = claims_mod.tally(all_claims)
    summary = "".join(
        f"<tr><th>{label}</th>"
        + "".join(
            f"<td style='color:{_COLOR[v]};font-weight:600'>{v}: {t[key][v]}</td>"
            for v in claims_mod.VERDICTS
        )
        + "</tr>"
        for key, label in (
            ("raw", "claims"),
            ("holm", "claims, Holm-adjusted"),
            ("control", "controls (not counted)"),
            ("sanity", "sanity checks (not counted)"),
        )
        if key in ("raw", "holm") or any(t[key].values())
    )
    n_apart = [
        f"{k} {claims_mod.unit_text(k, noun)}"
        for k, noun in (
            (sum(t["control"].values()), "controls"),
            (sum(t["sanity"].values()), "sanity checks"),
        )
        if k
    ]
    n_raw = sum(t["raw"].values())
    counted = f"{n_raw} {claims_mod.unit_text(n_raw, 'claims')}" + (
        f"; {' and '.join(n_apart)} shown apart" if n_apart else ""
    )
    found = findings(state, exps)
    lead = (
        "<section id=findings><h2>Findings</h2>"
        + (
            "<ul class=findings>" + "".join(f"<li>{html.escape(x)}</li>" for x in found) + "</ul>"
            if found
            else "<p><i>no experiment has finished yet</i></p>"
        )
        + "<h3>Every claim</h3>"
        + claims_table(state, experiments, adjusted)
        + "</section>"
    )
    finished = sum(1 for e in state["experiments"].values() if e.get("status") in FINISHED)
    toc = " &middot; ".join(f"<a href='#{e}'>{e}</a>" for e in experiments)
    top = (
        f"<div class=topfig><h3>Figure 1: token norms by site; the ME layer</h3>{top_figure}</div>"
        if top_figure
        else ""
    )
    body = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>me_interp report</title>
<script src="{io.PLOTLY_JS}"></script>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; max-width: 1400px; }}
table {{ border-collapse: collapse; width: 100%; margin-bottom: 1em; }}
td, th {{ border: 1px solid #d0d7de; padding: 6px 8px; vertical-align: top; font-size: 14px; }}
th {{ background: #f6f8fa; text-align: left; }}
table.card {{ width: auto; min-width: 420px; }}
table.card th {{ white-space: nowrap; }}
tr.sanity td, li.sanity {{ background: #f6f8fa; color: #57606a; }}
code {{ background: #f6f8fa; padding: 1px 4px; }}
section {{ border-top: 2px solid #d0d7de; margin-top: 1.5em; }}
.head {{ display: flex; gap: 2em; flex-wrap: wrap; align-items: flex-start; }}
.row {{ display: flex; gap: 1.5em; align-items: flex-start; }}
.claimcol {{ flex: 1 1 40%; min-width: 320px; }}
.figcol {{ flex: 1 1 60%; min-width: 420px; position: sticky; top: 0; }}
ul.claims {{ list-style: none; padding: 0; margin: 0; font-size: 14px; }}
ul.claims li {{ border-left: 4px solid #d0d7de; padding: 4px 8px; margin-bottom: 8px; }}
.verdict {{ font-weight: 700; }}
.figure {{ margin-bottom: 1em; }}
.figlink {{ font-size: 13px; text-align: right; }}
.links {{ font-size: 13px; }}
details {{ margin: 0.5em 0 1em; }}
summary {{ cursor: pointer; color: #0969da; }}
table.claimtable td, table.claimtable th {{ padding: 1px 6px; font-size: 12px; line-height: 1.35; }}
ul.findings li {{ margin-bottom: 4px; }}
.defs {{ font-size: 13px; color: #57606a; margin: 0.5em 0; }}
</style></head><body>
<h1>me_interp report</h1>
{lead}
<div class=head>{_model_card(out, state, exps)}
<div><table><tr><th colspan=5>claims of the paper and its critics on this model
({counted})</th></tr>{summary}</table>
<p>{finished} of {len(experiments)} experiments finished. Layers are 0-based (1-based in parentheses
where given).</p>
<details style='font-size:14px'><summary>how a verdict is decided</summary>
<p>Each claim is decided by one rule: it <b>holds</b> when the whole 95%
interval of its statistic (a seeded percentile bootstrap over prompts or texts, a two-way one over
prompts &times; seeds for random controls, an exact Clopper&ndash;Pearson interval for k-of-n outcomes
such as partner layers) lies on the claimed side of the threshold, <b>fails</b> when none of it does,
and is <b>inconclusive</b> when the interval straddles the threshold or rests on fewer than two
distinct measurements. <b>Not applicable</b>: the claim presupposes something this model lacks (the
reason is given). The Holm-adjusted counts keep a decided verdict only when its p-value survives
Holm's step-down over all the claims of this report. Controls (comparisons that must come out as
designed) and sanity checks (true by construction), in grey, are not evidence. Thresholds: <code>me_interp.claims.THRESHOLDS</code> (docs/claims.md). Each figure is
interactive (hover, zoom); its full file is one click away.</p></details>
<p style='font-size:13px'>{toc}</p></div></div>
{top}
{"".join(sections)}
{_DRAW_SCRIPT}
</body></html>
"""
    io.atomic_write_text(out / SUMMARY_FILE, verdicts_markdown(state, experiments, found))
    return io.atomic_write_text(out / REPORT_FILE, body)


def cost_text(entry: Mapping[str, Any]) -> str:
    """An experiment's wall time and peak memory as recorded in battery.json (``usage.track``)."""
    if entry.get("seconds") is None:
        return "time not recorded"
    text = f"{terminal.fmt_seconds(entry['seconds'])}"
    if entry.get("peak_rss_mib") is not None:
        scope = "" if entry.get("rss_scope", "block") == "block" else " (process peak)"
        text += f", peak RSS {entry['peak_rss_mib']:.0f} MiB{scope}"
    if entry.get("peak_cuda_mib") is not None:
        text += f", peak CUDA {entry['peak_cuda_mib']:.0f} MiB"
    return text


def finished_claims(state: dict[str, Any], experiments: Sequence[str]) -> list[dict[str, Any]]:
    """Every claim (as stored in battery.json) of the experiments that finished, in order."""
    out: list[dict[str, Any]] = []
    for name in experiments:
        entry = state["experiments"].get(name) or {}
        if entry.get("status") in FINISHED:
            out.extend(entry.get("claims") or [])
    return out


def md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def verdicts_markdown(
    state: dict[str, Any], experiments: Sequence[str], lines: Sequence[str] = ()
) -> str:
    """``<out>/report.md``: the findings ``lines`` (:func:`findings`), then one table row per claim
    (verdict, estimate with interval, n), ready to paste; sanity checks are marked and
    not-applicable rows give the reason."""

    all_claims = finished_claims(state, experiments)
    adjusted = dict(zip((d["id"] for d in all_claims), claims_mod.holm(all_claims), strict=True))
    rows = [
        "| experiment | claim | kind | verdict | Holm-adjusted | estimate [95% CI] | n |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in experiments:
        entry = state["experiments"].get(name)
        if entry is None or entry.get("status") not in FINISHED:
            status = "not run" if entry is None else f"failed: {entry.get('error', '')}"
            rows.append(f"| {name} | | | {md_cell(status)} | | | |")
            continue
        for d in entry.get("claims") or []:
            c = claims_mod.Claim.from_dict(d)
            verdict = f"**{c.verdict}**"
            if c.estimate is None:
                est, n = md_cell(c.why), ""
            else:
                e = c.estimate
                est = claims_mod.fmt_num(e.value)
                if e.method != "exact":
                    est += f" [{claims_mod.fmt_num(e.lo)}, {claims_mod.fmt_num(e.hi)}]"
                n = f"{e.n} {claims_mod.unit_text(e.n, e.unit)}" + (
                    f" ({e.n_eff} distinct)" if e.n_eff is not None and e.n_eff != e.n else ""
                )
            rows.append(
                f"| {name} | `{c.id}` | {'corollary' if c.implied_by else c.kind} | {verdict} | {adjusted.get(c.id, c.verdict)} | "
                f"{est} | {n} |"
            )
    head = claims_mod.tally_text(claims_mod.tally(all_claims))
    costs = [
        f"| {name} | {(state['experiments'].get(name) or {}).get('status', 'not run')} | "
        f"{cost_text(state['experiments'].get(name) or {})} |"
        for name in experiments
    ]
    total = sum(
        (state["experiments"].get(name) or {}).get("seconds") or 0.0 for name in experiments
    )
    found = "".join(f"- {x}\n" for x in lines)
    lines = [
        f"- {name}: {terminal.verbose_line(claims_mod.Claim.from_dict(d))}"
        for name in experiments
        for d in (state["experiments"].get(name) or {}).get("claims") or []
    ]
    return (
        (f"Findings:\n\n{found}\n" if found else "")
        + f"{head}\n\n"
        + "\n".join(rows)
        + "\n\nEach claim in full (statistic, interval, n, rule, control, context):\n\n"
        + "\n".join(lines)
        + f"\n\nCost per experiment (wall time, peak memory; {terminal.fmt_seconds(total)} in all):"
        + "\n\n| experiment | status | cost |\n| --- | --- | --- |\n"
        + "\n".join(costs)
        + "\n"
    )


def _relpath(path: Path, start: Path) -> str:
    import os

    return os.path.relpath(path, start)
