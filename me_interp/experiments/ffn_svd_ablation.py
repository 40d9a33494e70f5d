"""FFN singular-direction and neuron ablation at the ME layer: which directions make the massive activation?

With ``W = U diag(s) Vᵀ`` (``s`` descending), removing a set ``S`` of singular directions sets
``W ← W − Σ_{i∈S} s_i u_i v_iᵀ`` for ``W`` one of ``W_down``, ``W_up``, ``W_gate`` of the ME layer
``m`` (``me_interp.edits.directions_removed``, the same edit as ``me_interp.edits.svd_ablated`` for
``S = {0..k−1}``; the SVD of each matrix is computed once, ``edits.SVD``). Edits:

* ``svd``: the top ``k`` directions, for every ``k`` of the sweep ``ks`` and for ``claim_k``;
* ``svd_random``: the control, ``claim_k`` directions drawn (seeded) from the *other* ones
  (ranks ``claim_k..rank−1``), ``n_random`` seeds;
* ``neurons``: the FFN neurons that write most into the massive dims, each alone and the top
  ``n_neurons`` together (gate row, up row and down column zeroed, ``edits.neurons_ablated``);
* ``neurons_random``: the control, ``n_neurons`` neurons drawn (seeded) from the others.

Neuron score (the probe ``probes.ffn.neuron_scores``): at the massive token ``t_b`` of each prompt
``b`` (the unedited ME layer's massive position), ``score_n = mean_b ‖ act_n(b, t_b) · W_down[D, n] ‖₂``
with ``act = σ(W_gate x) ⊙ W_up x`` (``mlp.hook_post``) and ``D`` the massive dims: how much neuron
``n`` writes into the massive dims.

The statistic of every claim is the excess the edit leaves, ``c = (R̄_m(edited) − 1) /
(R̄_m(unedited) − 1)`` with ``R̄_m`` the mean over prompts of ``R_{m,b} = max_t ‖h_{m,b,t}‖ /
mean_{t≠argmax} ‖h_{m,b,t}‖`` of layer ``m``'s output (as in ``rmsnorm_permutation``); an edit
*removes* the massive activation when ``c`` is at most the table's ``removed`` fraction.

Claims (:data:`SPECS`, declarative, judged by :func:`me_interp.claims.judge`): the claims (evidence)
``svd_<matrix>_removes`` (the top ``claim_k`` directions of each matrix), ``top_neuron_removes`` and
``top_neurons_remove``, each bootstrapped over prompts (edited and unedited means resampled together);
the neurons are scored and chosen on the selection half of the prompts (one unit per distinct
massive-token prefix, ``probes.site.massive_units``) and their claims and control are tested on the
held-out half only, so a neuron chosen for noise in the selection prompts cannot make its claim hold;
and the controls ``svd_<matrix>_random_keeps`` and ``random_neurons_keep`` (``claim_k`` other
directions, ``n_neurons`` other neurons: they must keep the activation for the claims beside them to
be specific, and are never counted as evidence). A control is measured on prompts × seeds
(``Result.seed_values``: per prompt and seed, ``(R_{m,b}(edited, seed) − 1) / (R̄_m(unedited) − 1)``,
whose mean is the mean over seeds of ``c``) with a two-way (crossed) bootstrap over prompts and seeds
(:class:`me_interp.claims.Nested`; the unedited mean held fixed), and needs at least
:data:`me_interp.claims.MIN_SEEDS` seeds, else it is not applicable.

    python -m me_interp.experiments.ffn_svd_ablation
    python -m me_interp.experiments.ffn_svd_ablation --ks 1 2 4 --matrices down --n-neurons 5
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import plotly.graph_objects as go
import torch

from me_interp import claims, terminal
from me_interp.claims import excess_stat
from me_interp.edits import (
    MATRICES,
    SVD,
    directions_removed,
    ffn_matrix,
    neurons_ablated,
)
from me_interp.experiments._weights import (
    EDIT_COLUMNS,
    EditRow,
    Measurement,
    WeightConfig,
    fmt_value,
    prepare,
    where_edited,
)
from me_interp.loading.loaded import LoadedModel
from me_interp.probes.ffn import neuron_scores
from me_interp.probes.site import Units, massive_units
from me_interp.study import Experiment, Headed, RunHeader, checked, command, run_header
from me_interp.terminal import fmt_table

NAME = "ffn_svd_ablation"
KINDS = ("svd", "svd_random", "neurons", "neurons_random")
"""The edits (module docstring), in table order."""


@dataclass(frozen=True)
class Config(WeightConfig):
    """FFN-ablation settings.

    Attributes:
        matrices: which FFN matrices to ablate.
        ks: the sweep: how many top singular directions to remove (each value separately).
        claim_k: how many top singular directions the claims remove (the paper's "a few"; run even
            when not in ``ks``); the random control removes as many of the others (at most half the
            rank).
        n_neurons: how many of the top-scoring neurons to ablate (each alone, then all together);
            the random control ablates as many others.
        n_random: seeds (``seed, seed+1, …``) of each random control (the claims need at least 5).
    """

    matrices: tuple[str, ...] = checked(("down", "up", "gate"), choices=MATRICES)
    ks: tuple[int, ...] = checked((1, 2, 4, 8, 16, 32), ge=1)
    claim_k: int = checked(8, ge=1)
    n_neurons: int = checked(3, ge=0)
    n_random: int = checked(5, ge=0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.matrices and not self.n_neurons:
            raise ValueError("nothing to ablate: give matrices or n_neurons > 0")

    def sweep(self) -> list[int]:
        """The ``k`` values run: ``ks`` and ``claim_k``, sorted."""
        return sorted({*self.ks, self.claim_k})


def random_others(n_total: int, exclude: Sequence[int], k: int, seed: int) -> list[int]:
    """``k`` distinct indices of ``0..n_total−1`` outside ``exclude``, drawn with a seeded generator,
    sorted."""
    skip = set(exclude)
    pool = torch.tensor([i for i in range(n_total) if i not in skip])
    if k > len(pool):
        raise ValueError(f"cannot draw {k} of the {len(pool)} indices left")
    gen = torch.Generator().manual_seed(seed)
    return sorted(pool[torch.randperm(len(pool), generator=gen)[:k]].tolist())


@dataclass(frozen=True)
class Ablation(EditRow):
    """One ablation of the ME layer's FFN and what it left (:class:`EditRow`).

    Attributes:
        kind: :data:`KINDS`; ``matrix``: the ablated matrix (``svd``, ``svd_random``); ``k``: how
            many directions; ``directions``: the removed singular directions; ``neurons``: the
            ablated neurons; ``seed``: the draw of a random control.
    """

    kind: str
    matrix: str | None = None
    k: int | None = None
    directions: list[int] | None = None
    neurons: list[int] | None = None
    seed: int | None = None

    def label(self) -> str:
        if self.kind == "svd":
            return f"W_{self.matrix} top {self.k}"
        if self.kind == "svd_random":
            return f"W_{self.matrix} {self.k} others, seed {self.seed}"
        if self.kind == "neurons":
            return "neurons " + " + ".join(map(str, self.neurons))
        return f"{len(self.neurons)} other neurons, seed {self.seed}"


@dataclass(frozen=True)
class Spectrum:
    """The largest singular values of one FFN matrix of the ME layer (as many as the sweep's
    largest ``k``)."""

    matrix: str
    values: list[float]


@dataclass(frozen=True)
class Result(Headed):
    """The ablations of the ME layer's FFN and what they did (``header.layer``: the ablated layer).

    Attributes:
        baseline: the unedited model's :class:`Measurement`.
        rows: every ablation (:class:`Ablation`), in run order.
        singular_values: per ablated matrix, its top singular values.
        neurons, neuron_scores: the top neurons (by writes into ``massive_dims``) and their scores,
            chosen on the selection half of ``units``.
        units: the prompts grouped by massive-token prefix, and the selection / held-out halves.
    """

    header: RunHeader
    baseline: Measurement
    rows: list[Ablation]
    singular_values: list[Spectrum]
    neurons: list[int]
    neuron_scores: list[float]
    massive_dims: list[int]
    claim_k: int
    prompt_lengths: list[int]
    units: Units

    @property
    def massive_at_layer(self) -> bool:
        """Whether the unedited model's output at ``layer`` has a massive activation."""
        return bool(self.baseline.has_massive[self.layer])

    def spectrum(self, matrix: str) -> list[float]:
        """The top singular values of ``matrix`` (empty when it was not ablated)."""
        return next((s.values for s in self.singular_values if s.matrix == matrix), [])

    def select(self, kind: str, matrix: str | None = None) -> list[Ablation]:
        return [r for r in self.rows if r.kind == kind and (matrix is None or r.matrix == matrix)]

    def svd_row(self, matrix: str, k: int) -> Ablation | None:
        return next((r for r in self.select("svd", matrix) if r.k == k), None)

    def kill_k(self, matrix: str) -> int | None:
        """The smallest swept ``k`` whose removal leaves no massive activation at the layer."""
        ks = [r.k for r in self.select("svd", matrix) if not r.survives]
        return min(ks) if ks else None

    def seed_values(
        self, kind: str, matrix: str | None = None, prompts: Sequence[int] | None = None
    ) -> np.ndarray:
        """``[prompt, seed]`` of a random control: ``(R_{m,b}(edited) − 1) / (R̄_m(unedited) − 1)``
        over the prompts ``prompts`` (``None``: all; the unedited mean over the same prompts),
        whose mean over prompts is that seed's ``c`` (the cells of a
        :class:`~me_interp.claims.Nested` measurement)."""
        rows = self.select(kind, matrix)
        idx = list(range(self.n_prompts)) if prompts is None else list(prompts)
        base = float(np.mean(np.asarray(self.baseline.prompt_ratio_at(self.layer))[idx])) - 1.0
        edited = np.asarray([r.ratio_at_layer_per_prompt for r in rows], dtype=np.float64)
        return ((edited[:, idx] - 1.0) / base).T  # [prompt seed]

    @property
    def neuron_prompts(self) -> list[int]:
        """The prompts the neuron claims are tested on: the held-out half (the neurons were chosen
        on the selection half), or every prompt when fewer than two distinct massive-token
        prefixes leave nothing to hold out."""
        return self.units.prompts(self.units.heldout)

    def neuron_rows(self) -> list[Ablation]:
        return self.select("neurons")

    def neurons_row(self, neurons: Sequence[int]) -> Ablation | None:
        return next((r for r in self.neuron_rows() if r.neurons == list(neurons)), None)


def run(cfg: Config, model: LoadedModel | None = None) -> Result:
    """Ablate singular directions and neurons of the ME layer's FFN and measure.

    Raises:
        NotApplicable: no ``layer`` given and the model has no massive activation.
        ValueError: a ``k`` above the rank of a matrix or ``claim_k`` above half of it (checked before
            any forward), ``n_neurons`` above half of ``d_mlp``, a layer out of range.
    """
    s = prepare(cfg, model)
    m = s.layer
    for mat in cfg.matrices:
        rank = min(ffn_matrix(s.model, m, mat).shape)
        if max(cfg.sweep()) > rank:
            raise ValueError(
                f"k={max(cfg.sweep())} exceeds the rank of W_{mat} ({rank} singular directions)"
            )
        if cfg.n_random and 2 * cfg.claim_k > rank:
            raise ValueError(
                f"claim_k={cfg.claim_k} leaves too few other directions of W_{mat} (rank {rank}) "
                "for the random control: at most half the rank"
            )
    if cfg.n_neurons > s.model.d_mlp // 2:
        raise ValueError(
            f"n_neurons={cfg.n_neurons} exceeds half the FFN width d_mlp={s.model.d_mlp} (the "
            "random control draws as many other neurons)"
        )
    # without a massive activation (an explicit --layer on a model without one) score all dims
    dims = s.location.massive_dims or list(range(s.model.d_model))
    ref = torch.tensor([p[0] for p in s.positions])
    # the neurons are chosen on the selection half and their claims tested on the held-out half
    units = massive_units(s.batch.tokens, ref.tolist(), cfg.seed)
    sel = units.prompts(units.select)
    scores = neuron_scores(s.model, s.batch, m, ref, dims, sel) if cfg.n_neurons else torch.zeros(0)
    top = scores.argsort(descending=True)[: cfg.n_neurons].tolist()
    svds = {mat: SVD.of(ffn_matrix(s.model, m, mat)) for mat in cfg.matrices}

    edits: list[tuple[dict, Any]] = []
    for mat in cfg.matrices:
        W = ffn_matrix(s.model, m, mat)
        for k in cfg.sweep():
            what = {"kind": "svd", "matrix": mat, "k": k, "directions": list(range(k))}
            edits.append((what, partial(directions_removed, W, svds[mat], range(k))))
        for i in range(cfg.n_random):
            d = random_others(svds[mat].rank, range(cfg.claim_k), cfg.claim_k, cfg.seed + i)
            what = {"kind": "svd_random", "matrix": mat, "k": cfg.claim_k, "directions": d}
            edits.append(
                ({**what, "seed": cfg.seed + i}, partial(directions_removed, W, svds[mat], d))
            )
    groups = [[n] for n in top] + ([top] if len(top) > 1 else [])
    for g in groups:
        edits.append(({"kind": "neurons", "neurons": g}, partial(neurons_ablated, s.model, m, g)))
    for i in range(cfg.n_random if top else 0):
        g = random_others(s.model.d_mlp, top, len(top), cfg.seed + i)
        what = {"kind": "neurons_random", "neurons": g, "seed": cfg.seed + i}
        edits.append((what, partial(neurons_ablated, s.model, m, g)))

    rows = []
    s.reuse_from([m])  # every edit is in layer m's FFN
    for what, ctx in terminal.bar(edits, desc=NAME):
        with ctx():
            after = s.measure(start=m)
        rows.append(Ablation.measured(after, s.baseline, m, **what))
    return Result(
        header=run_header(cfg, s.model, len(s.batch), s.site),
        baseline=s.baseline,
        rows=rows,
        singular_values=[
            Spectrum(mat, svds[mat].S[: max(cfg.sweep())].tolist()) for mat in cfg.matrices
        ],
        neurons=top,
        neuron_scores=[float(scores[n]) for n in top],
        massive_dims=list(dims),
        claim_k=cfg.claim_k,
        prompt_lengths=s.batch.lengths,
        units=units,
    )


# ------------------------------------------------------------------------------------------
# claims
# ------------------------------------------------------------------------------------------

_STAT = (
    "c = (R_m(edited) − 1) / (R_m(unedited) − 1), R_m the ME layer's output norm ratio (mean over "
    "prompts)"
)
_DET = "; bootstrap over prompts (edited and unedited means together)"
_HELD = (
    "; the neurons chosen on the selection half of the prompts (one unit per distinct "
    "massive-token prefix), the edit scored on the held-out half; bootstrap over held-out prompts "
    "(edited and unedited means together)"
)
_SEEDS = (
    ", mean over the random draws (seeds); two-way (crossed) bootstrap over prompts × seeds of "
    "(R_m,b(edited) − 1) / (R_m(unedited) − 1), the unedited mean held fixed"
)


def _massive(result: Result) -> str | None:
    if not result.massive_at_layer:
        return (
            f"no massive activation at layer {result.layer} of the unedited model (the layer was "
            "given, not detected): there is nothing for the ablations to remove"
        )
    return None


def _deterministic(
    name: str,
    statement: str,
    section: str,
    control: str,
    row: Callable[[Result], Ablation | None],
    missing: str,
    extra: Callable[[Result], str],
    held_out: bool = False,
) -> claims.Spec:
    def stat(result: Result) -> claims.Sample:
        r = row(result)
        if r is None:
            raise claims.NotApplicable(f"not measured in this run: {missing}")
        pairs = np.column_stack(
            [r.ratio_at_layer_per_prompt, result.baseline.prompt_ratio_at(result.layer)]
        )
        if not held_out:
            return claims.Sample(pairs, excess_stat)
        # c depends on every token of a prompt (the others' norms), so each prompt is its own
        # measurement even when prompts share the massive token's prefix
        rows = result.neuron_prompts
        unit = "held-out prompts" if result.units.held_out else "prompts (nothing held out)"
        return claims.Sample(pairs[rows], excess_stat, unit=unit)

    def details(result: Result) -> str:
        r = row(result)
        held = ""
        if held_out:  # the numbers the statistic is computed from: the held-out prompts' means
            rows = result.neuron_prompts
            before = np.asarray(result.baseline.prompt_ratio_at(result.layer))[rows].mean()
            after = np.asarray(r.ratio_at_layer_per_prompt)[rows].mean()
            held = (
                f"; the means c is computed from, on the {len(rows)} prompts tested (prompts "
                f"{rows}): R_m {fmt_value(before)} → {fmt_value(after)}"
            )
        return (
            f"{where_edited(result)}; {r.label()}: R_m after {fmt_value(r.ratio_at_layer)} "
            f"(median over all prompts){held}, survives {'yes' if r.survives else 'no'}; {extra(result)}"
        )

    return claims.Spec(
        f"{NAME}.{name}",
        section,
        statement,
        _STAT + (_HELD if held_out else _DET),
        "<=",
        "removed",
        control,
        stat=stat,
        unit="prompts",
        applies=_massive,
        details=details,
    )


def _control(
    name: str,
    statement: str,
    section: str,
    control: str,
    kind: str,
    matrix: str | None,
    missing: str,
    extra: Callable[[Result], str],
    held_out: bool = False,
) -> claims.Spec:
    def applies(result: Result) -> str | None:
        if why := _massive(result):
            return why
        n = len(result.select(kind, matrix))
        if n == 0:
            return f"not measured in this run: {missing}"
        return claims.too_few_seeds(n, "--n-random")

    def details(result: Result) -> str:
        rows = result.select(kind, matrix)
        changes = ", ".join(fmt_value(r.change) for r in rows)
        return (
            f"{where_edited(result)}; c per seed {changes}; survives "
            f"{sum(r.survives for r in rows)}/{len(rows)}; {extra(result)}"
        )

    return claims.Spec(
        f"{NAME}.{name}",
        section,
        statement,
        _STAT + _SEEDS,
        ">",
        "removed",
        control,
        kind="control",
        stat=lambda r: claims.Nested(
            r.seed_values(kind, matrix, r.neuron_prompts if held_out else None)
        ),
        unit="prompts",
        applies=applies,
        details=details,
    )


def _svd_extra(mat: str) -> Callable[[Result], str]:
    def extra(result: Result) -> str:
        sv = result.spectrum(mat)
        return f"top singular values {_fmt_list(sv[:3])}; smallest killing k {result.kill_k(mat)}"

    return extra


def _top_change(mat: str) -> Callable[[Result], str]:
    def extra(result: Result) -> str:
        top = result.svd_row(mat, result.claim_k)
        return f"top-{result.claim_k} removal: c {fmt_value(top.change) if top else 'not run'}"

    return extra


def _about_neurons(result: Result) -> str:
    u = result.units
    if u.held_out:
        where = f"on the selection half) by writes into dims {result.massive_dims[:4]}; {u.text()}"
    else:  # one massive-token prefix: its scores are the same on every prompt, any half picks them
        where = (
            f"by writes into dims {result.massive_dims[:4]}); every prompt has the same "
            "massive-token prefix, so the scores are one measurement and any half of the prompts "
            f"picks the same neurons: chosen and scored on all {result.n_prompts} prompts (c still "
            "varies by prompt through the other tokens' norms)"
        )
    return f"top neurons {result.neurons} (scores {_fmt_list(result.neuron_scores)}, {where}"


def _first_neuron(result: Result) -> Ablation | None:
    return result.neurons_row(result.neurons[:1]) if result.neurons else None


def _all_neurons(result: Result) -> Ablation | None:
    if len(result.neurons) > 1:
        return result.neurons_row(result.neurons)
    return _first_neuron(result)


def _random_neurons_extra(result: Result) -> str:
    top = max(result.neuron_scores, default=None)
    return f"{len(result.neurons)} neurons per draw; top score {fmt_value(top)}"


_REMOVES = {
    mat: _deterministic(
        f"svd_{mat}_removes",
        f"Removing the top singular directions (k = claim_k) of the ME layer's W_{mat} removes "
        "the massive activation",
        "§2 claim 3 (the FFN creates it); §3 singular-direction ablation",
        f"as many other singular directions of W_{mat} (ffn_svd_ablation.svd_{mat}_random_keeps)",
        lambda r, mat=mat: r.svd_row(mat, r.claim_k),
        f"W_{mat} not ablated",
        _svd_extra(mat),
    )
    for mat in MATRICES
}
_KEEPS = {
    mat: _control(
        f"svd_{mat}_random_keeps",
        f"Removing as many singular directions of W_{mat} drawn from the others (not the top "
        "k) does not remove the massive activation",
        "§3 singular-direction ablation (control: other directions)",
        f"the top-k directions (ffn_svd_ablation.svd_{mat}_removes)",
        "svd_random",
        mat,
        f"W_{mat} not ablated",
        _top_change(mat),
    )
    for mat in MATRICES
}
SPECS: tuple[claims.Spec, ...] = (
    *(_REMOVES[mat] for mat in MATRICES),
    *(_KEEPS[mat] for mat in MATRICES),
    _deterministic(
        "top_neuron_removes",
        "Ablating the single FFN neuron of the ME layer that writes most into the massive dims "
        "removes the massive activation",
        "§2 claim 3 (a few FFN neurons)",
        "as many other neurons (ffn_svd_ablation.random_neurons_keep)",
        _first_neuron,
        "no neuron ablated (--n-neurons 0)",
        _about_neurons,
        held_out=True,
    ),
    _deterministic(
        "top_neurons_remove",
        "Ablating the top FFN neurons of the ME layer (by their writes into the massive dims) "
        "together removes the massive activation",
        "§2 claim 3 (a few FFN neurons)",
        "as many other neurons (ffn_svd_ablation.random_neurons_keep)",
        _all_neurons,
        "no neuron ablated (--n-neurons 0)",
        _about_neurons,
        held_out=True,
    ),
    _control(
        "random_neurons_keep",
        "Ablating as many FFN neurons of the ME layer drawn from the others does not remove the "
        "massive activation",
        "§2 claim 3 (control: other neurons)",
        "the top neurons (ffn_svd_ablation.top_neurons_remove)",
        "neurons_random",
        None,
        "no neuron ablated (--n-neurons 0)",
        _random_neurons_extra,
        held_out=True,
    ),
)
claims.check_specs(SPECS)


def _fmt_list(xs) -> str:
    return "[" + ", ".join(f"{x:.4g}" for x in xs) + "]"


# ------------------------------------------------------------------------------------------
# figures and summary
# ------------------------------------------------------------------------------------------


def figures(result: Result) -> dict[str, go.Figure]:
    base = result.baseline.ratio_at(result.layer)
    fig = go.Figure()
    for mat in MATRICES:
        rows = result.select("svd", mat)
        if rows:
            fig.add_trace(
                go.Scatter(
                    x=[r.k for r in rows],
                    y=[r.ratio_at_layer for r in rows],
                    mode="lines+markers",
                    name=f"W_{mat}: top k",
                    hovertemplate="k=%{x}: ratio %{y:.4g}<extra>W_" + mat + "</extra>",
                )
            )
        rand = result.select("svd_random", mat)
        if rand:
            fig.add_trace(
                go.Scatter(
                    x=[r.k for r in rand],
                    y=[r.ratio_at_layer for r in rand],
                    mode="markers",
                    marker={"symbol": "circle-open"},
                    name=f"W_{mat}: k others (seeds)",
                )
            )
    # no annotation on the line: on a log axis plotly reads an annotation's y as log10(y)
    fig.add_hline(y=base, line_dash="dash", line_color="gray")
    fig.update_layout(
        title=f"Massive ratio at layer {result.layer} after removing singular directions — "
        f"{result.model}<br><sup>dashed: the unedited model ({base:.3g})</sup>",
        xaxis_title="k (directions removed)",
        xaxis_type="log",
        yaxis_title="max token / mean others at the ME layer",
        yaxis_type="log",
        template="plotly_white",
    )
    nrows = result.neuron_rows() + result.select("neurons_random")
    neu = go.Figure(
        go.Bar(
            x=[r.label() for r in nrows],
            y=[r.ratio_at_layer for r in nrows],
            marker_color=["seagreen" if r.survives else "firebrick" for r in nrows],
        )
    )
    neu.add_hline(y=base, line_dash="dash", line_color="gray")
    neu.update_layout(
        title=f"Ablating FFN neurons of layer {result.layer} (top by writes into dims "
        f"{result.massive_dims[:4]}, then random others)"
        "<br><sup>green: still massive; red: gone; dashed: unedited</sup>",
        xaxis_title="ablated neurons",
        yaxis_title="ratio at the ME layer",
        yaxis_type="log",
        template="plotly_white",
    )
    return {"svd_sweep": fig, "neuron_ablation": neu}


def summary(result: Result) -> str:
    rows = [(r.kind, r.matrix or "-", r.label(), *r.cells(), r.change) for r in result.rows]
    return "\n".join(
        [
            f"model: {result.model}   ME layer {result.layer} (1-based {result.layer + 1})   unedited "
            f"ratio {result.baseline.ratio_at(result.layer):.4g}   {result.n_prompts} prompts   top "
            f"neurons {result.neurons}",
            "",
            fmt_table(["edit", "matrix", "what", *EDIT_COLUMNS, "c"], rows),
        ]
    )


EXPERIMENT = Experiment(
    NAME, Config, run, SPECS, figures, summary, __doc__, key_figures=("svd_sweep",)
)
main = command(EXPERIMENT)


if __name__ == "__main__":
    raise SystemExit(main())
