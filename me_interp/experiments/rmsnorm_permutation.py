"""RMSNorm permutation: does the massive activation survive when the ME layer's gain is scrambled?

``RMSNorm(h) = h / sqrt(mean(h²) + eps) ⊙ w``: the paper (§2 claim 2) says the pre-FFN gain ``w`` of
the ME layer ``m`` puts the massive token's energy on the dims with large ``|w|``. Edits of ``w``
(``me_interp.edits.gains``), each on the pre-FFN norm (the test) and the pre-attention norm (the
control): ``random`` (``w ← w[π]``, ``n_random`` seeds), ``top`` (move only the ``top_k``
largest-``|w|`` dims), ``other`` (as many transpositions outside them: the control of ``top``) and
``flatten`` (``w ← mean(w) + α (w − mean(w))``). Every claim reads the excess the edit leaves,
``c = (R̄_m(edited) − 1) / (R̄_m(unedited) − 1)`` with ``R_{l,b} = max_t ‖h_{l,b,t}‖ /
mean_{t≠argmax} ‖h_{l,b,t}‖`` (``claims.excess_fraction``: 1 untouched, 0 an ordinary token); the
claims and their statistics are :data:`SPECS` (docs/claims.md).

    python -m me_interp.experiments.rmsnorm_permutation --n-random 10 --top-k 4 --alphas 0 0.5
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from me_interp import claims, terminal
from me_interp.claims import excess_stat
from me_interp.edits import NORMS, flattened_gain, gain, permuted_gain, random_permutation, top_dims
from me_interp.edits.gains import other_dims_permutation, top_dims_permutation
from me_interp.loading.loaded import LoadedModel
from me_interp.probes.measurement import EDIT_COLUMNS, EditRow, Measurement
from me_interp.probes.site import Site
from me_interp.study import Experiment, Headed, WeightConfig, checked, command, weights
from me_interp.study.result import RunHeader, run_header
from me_interp.study.weights import fmt_value, where_edited
from me_interp.terminal import fmt_table

NAME = "rmsnorm_permutation"
KINDS = ("random", "top", "other", "flatten")
"""The edits of a gain (module docstring), in table order."""
SEEDED = ("random", "top", "other")
"""The edits drawn at random, one per seed."""


@dataclass(frozen=True)
class Config(WeightConfig):
    """RMSNorm-permutation settings.

    Attributes:
        n_random: seeds (``seed, seed+1, …``) of each random edit (``random``, ``top``, ``other``);
            the claims on them need at least 5.
        top_k: how many of the largest-``|w|`` dims the ``top`` permutation moves (and how many
            transpositions the ``other`` control makes); at most ``d_model // 3``.
        alphas: flattening strengths ``α`` (1 = unchanged, 0 = constant gain; the claim is at 0).
        norms: which norms to edit: ``ffn`` (pre-FFN, the test) and/or ``attn`` (control).
    """

    n_random: int = checked(5, ge=0)
    top_k: int = checked(8, ge=1)
    alphas: tuple[float, ...] = checked((0.0, 0.5), ge=0, finite=True)  # below 0 inverts the gain
    norms: tuple[str, ...] = checked(("ffn", "attn"), choices=NORMS, nonempty=True)


@dataclass(frozen=True)
class GainEdit(EditRow):
    """One edit of a gain of the ME layer: ``norm``, ``kind`` (:data:`KINDS`) and ``param`` (the
    seed, or ``α`` for ``flatten``), and what it left (:class:`EditRow`)."""

    norm: str
    kind: str
    param: int | float

    def label(self) -> str:
        what = f"α={self.param:g}" if self.kind == "flatten" else f"seed {self.param}"
        return f"{self.norm} {self.kind} {what}"


@dataclass(frozen=True)
class GainTop:
    """The ``top_k`` largest-``|w|`` dims of one norm's gain at the ME layer."""

    norm: str
    dims: list[int]


@dataclass(frozen=True)
class Result(Headed):
    """The edits of the ME layer's gains and what they did (``header.layer``: the edited layer).

    Attributes:
        baseline: the unedited model's :class:`Measurement`.
        rows: every edit (:class:`GainEdit`), in run order.
        top_dims: per edited norm, its ``top_k`` largest-``|w|`` dims.
        prompt_lengths: the prompts' token counts.
    """

    header: RunHeader
    baseline: Measurement
    rows: list[GainEdit]
    top_dims: list[GainTop]
    top_k: int
    prompt_lengths: list[int]

    @property
    def massive_at_layer(self) -> bool:
        """Whether the unedited model's output at ``layer`` has a massive activation."""
        return bool(self.baseline.has_massive[self.layer])

    def top_dims_of(self, norm: str) -> list[int] | None:
        return next((g.dims for g in self.top_dims if g.norm == norm), None)

    def select(self, norm: str, kind: str) -> list[GainEdit]:
        return [r for r in self.rows if r.norm == norm and r.kind == kind]

    def survival(self, norm: str, kind: str) -> float | None:
        rows = self.select(norm, kind)
        return sum(r.survives for r in rows) / len(rows) if rows else None

    def seed_changes(self, norm: str, kind: str) -> list[float]:
        """Per seed of a random edit: the excess ``c`` it leaves."""
        return [r.change for r in self.select(norm, kind)]

    def seed_measure(self, norm: str, kind: str) -> claims.Nested:
        """A random edit's cells ``R_{m,b}(edited) − 1`` ``[prompt, seed]`` over the unedited
        ``R_{m,b} − 1`` of the same prompts (``den``, resampled with them): the mean over prompts
        of a seed's cells over the denominators' mean is that seed's ``c``."""
        rows = self.select(norm, kind)
        edited = np.asarray([r.ratio_at_layer_per_prompt for r in rows], dtype=np.float64)
        base = np.asarray(self.baseline.prompt_ratio_at(self.layer), dtype=np.float64)
        return claims.Nested(edited.T - 1.0, den=base - 1.0)

    def flatten_row(self, norm: str, alpha: float) -> GainEdit | None:
        return next((r for r in self.select(norm, "flatten") if math.isclose(r.param, alpha)), None)


def _edits(model: LoadedModel, cfg: Config, layer: int) -> Iterator[tuple[str, str, Any, Any]]:
    """(norm, kind, parameter, context manager) for every edit of the run."""
    for norm in cfg.norms:
        w = gain(model, layer, norm)
        for kind, perm in (
            ("random", partial(random_permutation, w.numel())),
            ("top", partial(top_dims_permutation, w, cfg.top_k)),
            ("other", partial(other_dims_permutation, w, cfg.top_k)),
        ):
            for i in range(cfg.seed, cfg.seed + cfg.n_random):
                yield norm, kind, i, permuted_gain(model, layer, perm(i), norm)
        for a in cfg.alphas:
            yield norm, "flatten", float(a), flattened_gain(model, layer, a, norm)


def run(cfg: Config, model: LoadedModel | None = None, site: Site | None = None) -> Result:
    """Permute / flatten the ME layer's RMSNorm gains and measure. No printing, no files.

    Raises:
        NotApplicable: no ``layer`` given and the model has no massive activation.
        ValueError: ``top_k`` above a third of ``d_model``, a layer out of range.
    """
    s = weights.setup(EXPERIMENT, cfg, model, site)
    m = s.layer
    d = s.model.d_model
    if cfg.top_k > d // 3:
        raise ValueError(f"top_k must be at most d_model/3 = {d // 3}, got {cfg.top_k}")
    n_edits = len(cfg.norms) * (3 * cfg.n_random + len(cfg.alphas))
    rows = []
    s.reuse_from([m])  # every edit is a gain of layer m
    for norm, kind, param, ctx in terminal.bar(_edits(s.model, cfg, m), total=n_edits, desc=NAME):
        with ctx:
            after = s.measure(start=m)
        rows.append(GainEdit.measured(after, s.baseline, m, norm=norm, kind=kind, param=param))
    return Result(
        header=run_header(cfg, s.model, len(s.batch), s.site),
        baseline=s.baseline,
        rows=rows,
        top_dims=[GainTop(n, top_dims(gain(s.model, m, n), cfg.top_k)) for n in cfg.norms],
        top_k=cfg.top_k,
        prompt_lengths=s.batch.lengths,
    )


_STAT = (
    "c = (R_m(edited) − 1) / (R_m(unedited) − 1), R_m the ME layer's output norm ratio (mean over "
    "prompts)"
)
_SEEDS = (
    ", mean over the random {what} (seeds); two-way (crossed) bootstrap over the distinct "
    "massive-token prefixes × seeds of R_m,b(edited) − 1 over R_m,b(unedited) − 1, the "
    "unedited excess resampled with its prompts"
)
_NO_MASSIVE = (
    "no massive activation at layer {m} of the unedited model (the layer was given, not detected): "
    "there is nothing for the edits to remove"
)


def _massive(result: Result) -> str | None:
    if not result.massive_at_layer:
        return _NO_MASSIVE.format(m=result.layer)
    return None


def _control_text(result: Result, norm: str, kind: str) -> str:
    rows = result.select(norm, kind)
    if not rows:
        return f"{norm} {kind}: not run"
    return (
        f"{norm} {kind}: mean c {fmt_value(float(np.mean([r.change for r in rows])))}, "
        f"survives {sum(r.survives for r in rows)}/{len(rows)}"
    )


def _seeded_applies(norm: str, kind: str):
    def applies(result: Result) -> str | None:
        if why := _massive(result):
            return why
        n = len(result.select(norm, kind))
        if n == 0:
            return f"not measured in this run: no {norm} {kind} edit"
        return claims.too_few_seeds(n, "--n-random")

    return applies


def _seeded_details(norm: str, kind: str, other: tuple[str, str]):
    def details(result: Result) -> str:
        rows = result.select(norm, kind)
        top = f"; top-{result.top_k} dims {result.top_dims_of('ffn')}" if norm == "ffn" else ""
        changes = ", ".join(fmt_value(r.change) for r in rows)
        return (
            f"{where_edited(result)}; c per seed {changes}; survives "
            f"{sum(r.survives for r in rows)}/{len(rows)}{top}; "
            f"{_control_text(result, *other)}"
        )

    return details


def _seeded(name, section, statement, what, op, norm, kind, other, control, spec_kind="claim"):
    return claims.Spec(
        f"{NAME}.{name}",
        section,
        statement,
        _STAT + _SEEDS.format(what=what),
        op,
        "removed",
        control,
        kind=spec_kind,
        stat=lambda r: r.seed_measure(norm, kind),
        unit="prompts",
        massive_state=True,
        applies=_seeded_applies(norm, kind),
        details=_seeded_details(norm, kind, other),
    )


def _paired(row: GainEdit, base: Measurement, layer: int) -> np.ndarray:
    """``[prompt, 2]``: the edited and unedited ratio of each prompt at ``layer``."""
    return np.column_stack([row.ratio_at_layer_per_prompt, base.prompt_ratio_at(layer)])


def _flatten_stat(result: Result) -> claims.Sample:
    flat = result.flatten_row("ffn", 0.0)
    if flat is None:
        raise claims.NotApplicable("not measured in this run: α = 0 not in alphas")
    return claims.Sample(_paired(flat, result.baseline, result.layer), excess_stat)


def _flatten_details(result: Result) -> str:
    flat = result.flatten_row("ffn", 0.0)
    ctrl = result.flatten_row("attn", 0.0)
    ctrl_text = "attn flatten α=0: " + (
        "not run" if ctrl is None else f"c {fmt_value(ctrl.change)}"
    )
    return (
        f"{where_edited(result)}; R_m after {fmt_value(flat.ratio_at_layer)}, survives "
        f"{'yes' if flat.survives else 'no'}; {ctrl_text}"
    )


SPECS: tuple[claims.Spec, ...] = (
    _seeded(
        "ffn_permutation_removes",
        "§2 claim 2 (RMSNorm alignment); §3 permutation",
        "Randomly permuting the ME layer's pre-FFN RMSNorm gain removes the massive activation",
        "permutations",
        "<=",
        "ffn",
        "random",
        ("attn", "random"),
        "the same random permutations of the pre-attention gain "
        "(rmsnorm_permutation.attn_permutation_keeps)",
    ),
    _seeded(
        "attn_permutation_keeps",
        "§2 claim 2 (control: the other norm)",
        "Randomly permuting the ME layer's pre-attention RMSNorm gain does not remove the massive "
        "activation",
        "permutations",
        ">",
        "attn",
        "random",
        ("ffn", "random"),
        "the pre-FFN permutations (rmsnorm_permutation.ffn_permutation_removes)",
        "control",
    ),
    _seeded(
        "top_dims_removes",
        "§2 claim 2 (the large-|w| dims)",
        "Moving only the top-k |w| dims of the ME layer's pre-FFN gain removes the massive activation",
        "moves",
        "<=",
        "ffn",
        "top",
        ("ffn", "other"),
        "as many transpositions among the other dims (rmsnorm_permutation.other_dims_keep)",
    ),
    _seeded(
        "other_dims_keep",
        "§2 claim 2 (control: the small-|w| dims)",
        "Moving as many dims of the pre-FFN gain outside its top-k |w| dims does not remove the "
        "massive activation",
        "moves",
        ">",
        "ffn",
        "other",
        ("ffn", "top"),
        "the move of the top-k dims (rmsnorm_permutation.top_dims_removes)",
        "control",
    ),
    claims.Spec(
        f"{NAME}.flatten_removes",
        "§2 claim 2; §3 flattening",
        "Flattening the ME layer's pre-FFN gain to its mean (α = 0) removes the massive activation",
        f"{_STAT} with w ← mean(w); bootstrap over the distinct massive-token prefixes (edited and "
        "unedited means together)",
        "<=",
        "removed",
        "the same flattening of the pre-attention gain (in details)",
        stat=_flatten_stat,
        unit="prompts",
        massive_state=True,
        applies=_massive,
        details=_flatten_details,
    ),
)
claims.check_specs(SPECS)


def figures(result: Result) -> dict[str, go.Figure]:
    """The excess ``c`` each edit left (bars from 0: 1 = untouched, 0 = an ordinary token; the
    ratio itself in the hover), one panel per norm, and the flattening sweep."""
    norms = [n for n in NORMS if any(r.norm == n for r in result.rows)]
    titles = {"ffn": "pre-FFN gain (test)", "attn": "pre-attention gain (control)"}
    removed = claims.threshold("removed")
    fig = make_subplots(
        rows=1, cols=len(norms), subplot_titles=[titles[n] for n in norms], shared_yaxes=True
    )
    for c, norm in enumerate(norms, start=1):
        rows = [r for r in result.rows if r.norm == norm]
        fig.add_trace(
            go.Bar(
                x=[r.label().split(" ", 1)[1] for r in rows],
                y=[r.change for r in rows],
                customdata=[r.ratio_at_layer for r in rows],
                marker_color=["seagreen" if r.survives else "firebrick" for r in rows],
                showlegend=False,
                hovertemplate="%{x}<br>excess left c = %{y:.3g}<br>ratio at the ME layer "
                "%{customdata:.4g}<extra></extra>",
            ),
            row=1,
            col=c,
        )
        fig.add_hline(y=1.0, line_dash="dash", line_color="gray", row=1, col=c)
        fig.add_hline(y=removed, line_dash="dot", line_color="firebrick", row=1, col=c)
    fig.update_yaxes(rangemode="tozero", title_text="excess left c", col=1)
    fig.update_layout(
        title=f"What editing layer {result.layer}'s RMSNorm gain leaves of the massive activation — "
        f"{result.model}<br><sup>c = (R_m(edited) − 1) / (R_m(unedited) − 1), unedited R_m "
        f"{result.baseline.ratio_at(result.layer):.4g}; dashed: unedited (c = 1); dotted: "
        f"removed (c ≤ {removed:g}); green: still massive, red: gone</sup>",
        template="plotly_white",
    )
    flat = go.Figure()
    for norm in norms:
        rows = sorted(result.select(norm, "flatten"), key=lambda r: r.param)
        flat.add_trace(
            go.Scatter(
                x=[r.param for r in rows] + [1.0],
                y=[r.change for r in rows] + [1.0],
                mode="lines+markers",
                name=titles[norm],
            )
        )
    flat.update_layout(
        title=f"Flattening w → mean + α (w − mean) at layer {result.layer} — {result.model}",
        xaxis_title="α (1 = unchanged)",
        yaxis_title="excess left c (1 = unedited)",
        yaxis_rangemode="tozero",
        template="plotly_white",
    )
    return {"ratio_after_edit": fig, "flatten_sweep": flat}


def summary(result: Result) -> str:
    rows = [(r.norm, r.kind, r.param, *r.cells(), r.change) for r in result.rows]
    return "\n".join(
        [
            f"model: {result.model}   ME layer {result.layer} (1-based {result.layer + 1})   unedited "
            f"ratio {result.baseline.ratio_at(result.layer):.4g}   {result.n_prompts} prompts   "
            f"top-{result.top_k} dims { {g.norm: g.dims for g in result.top_dims} }",
            "",
            fmt_table(["norm", "edit", "seed/α", *EDIT_COLUMNS, "c"], rows),
        ]
    )


EXPERIMENT = Experiment(
    NAME,
    Config,
    run,
    SPECS,
    figures,
    summary,
    __doc__,
    key_figures=("ratio_after_edit",),
    inputs=weights.inputs,
)
main = command(EXPERIMENT)


if __name__ == "__main__":
    raise SystemExit(main())
