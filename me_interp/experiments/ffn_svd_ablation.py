"""FFN singular-direction and neuron ablation at the ME layer: which directions make the massive activation?

With ``W = U diag(s) Vᵀ`` one of ``W_down``, ``W_up``, ``W_gate`` of the ME layer ``m``: ``svd``
removes the top ``k`` directions for every ``k`` of ``ks`` and ``claim_k``, ``svd_random`` as many
others scaled to the top ``claim_k``'s energy (``edits.direction_plan``); ``neurons`` ablates the
neurons that write most into the massive dims (``probes.ffn.neuron_scores``, chosen on the selection
half of the prompts), each alone and together, against ``neurons_random``. Formulas: ``SPECS``.

    python -m me_interp.experiments.ffn_svd_ablation
    python -m me_interp.experiments.ffn_svd_ablation --ks 1 2 4 --matrices down --n-neurons 5
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import product

import numpy as np
import plotly.graph_objects as go
import torch

from me_interp import claims, edits, plotting, terminal
from me_interp.claims import excess_stat
from me_interp.edits import MATRICES, SVD, ffn_matrix, random_others
from me_interp.loading.loaded import LoadedModel
from me_interp.probes.ffn import neuron_scores
from me_interp.probes.measurement import EDIT_COLUMNS, EditRow, Measurement
from me_interp.probes.site import Site, Units, massive_units
from me_interp.study import (
    Experiment,
    Headed,
    RunHeader,
    WeightConfig,
    checked,
    command,
    run_header,
    weights,
)
from me_interp.study.weights import fmt_value, where_edited
from me_interp.terminal import fmt_table

NAME = "ffn_svd_ablation"
KINDS = ("svd", "svd_random", "neurons", "neurons_random")  # the edits, in table order


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


@dataclass(frozen=True)
class Ablation(EditRow):
    """One ablation of the ME layer's FFN and what it left (:class:`EditRow`): its ``kind``
    (:data:`KINDS`), ``matrix``, ``k`` and removed singular ``directions`` with their ``scale`` ``β``
    and ``energy`` ``‖ΔW‖_F² = β² Σ s_i²``, or its ``neurons``; ``seed``: a random draw's."""

    kind: str
    matrix: str | None = None
    k: int | None = None
    directions: list[int] | None = None
    scale: float | None = None
    energy: float | None = None
    neurons: list[int] | None = None
    seed: int | None = None

    def label(self) -> str:
        return {
            "svd": lambda: f"W_{self.matrix} top {self.k}",
            "svd_random": lambda: (
                f"W_{self.matrix} {self.k} others ×{self.scale:.3g}, seed {self.seed}"
            ),
            "neurons": lambda: "neurons " + " + ".join(map(str, self.neurons)),
        }.get(self.kind, lambda: f"{len(self.neurons)} other neurons, seed {self.seed}")()


@dataclass(frozen=True)
class Spectrum:
    """The largest singular values of one FFN matrix of the ME layer (as many as the largest k)."""

    matrix: str
    values: list[float]


@dataclass(frozen=True)
class Result(Headed):
    """The ablations of the ME layer's FFN (``header.layer``) in run order and what they left;
    the top ``neurons`` (by writes into ``massive_dims``) chosen on the selection half of ``units``."""

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
        return min((r.k for r in self.select("svd", matrix) if not r.survives), default=None)

    def seed_measure(
        self, kind: str, matrix: str | None = None, prompts: Sequence[int] | None = None
    ) -> claims.Nested:
        """A random control's cells ``R_{m,b}(edited) − 1`` ``[prompt, seed]`` over ``prompts``
        (``None``: all), over the unedited ``R_{m,b} − 1`` of the same prompts (``den``, resampled
        with them): the statistic of the ``_keeps`` claims."""
        rows = self.select(kind, matrix)
        idx = list(range(self.n_prompts)) if prompts is None else list(prompts)
        base = np.asarray(self.baseline.prompt_ratio_at(self.layer), dtype=np.float64)[idx]
        edited = np.asarray([r.ratio_at_layer_per_prompt for r in rows], dtype=np.float64)
        return claims.Nested(edited[:, idx].T - 1.0, den=base - 1.0, prompts=idx)

    @property
    def neuron_prompts(self) -> list[int]:
        """The held-out half of the prompts (all where nothing is held out): the neuron claims'."""
        return self.units.prompts(self.units.heldout)

    def neurons_row(self, neurons: Sequence[int]) -> Ablation | None:
        return next((r for r in self.select("neurons") if r.neurons == list(neurons)), None)


def run(cfg: Config, model: LoadedModel | None = None, site: Site | None = None) -> Result:
    """Ablate singular directions and neurons of the ME layer's FFN and measure (``NotApplicable``
    without a massive activation and no ``layer``; ``ValueError`` on a ``k``, ``claim_k`` or
    ``n_neurons`` too large for the matrices, checked before any forward)."""
    s = weights.setup(EXPERIMENT, cfg, model, site)
    m, k_max = s.layer, max(cfg.sweep())
    for mat in cfg.matrices:
        rank = min(ffn_matrix(s.model, m, mat).shape)
        if k_max > rank or (cfg.n_random and 2 * cfg.claim_k > rank):
            raise ValueError(
                f"k={k_max} exceeds the rank of W_{mat} ({rank}) or claim_k={cfg.claim_k} more than "
                "half the rank (the random control draws as many other directions)"
            )
    if cfg.n_neurons > s.model.d_mlp // 2:
        raise ValueError(f"n_neurons={cfg.n_neurons} exceeds half the FFN width {s.model.d_mlp}")
    # without a massive activation (an explicit --layer on a model without one) score all dims
    dims = s.location.massive_dims or list(range(s.model.d_model))
    ref = torch.tensor([p[0] for p in s.positions])
    # the neurons are chosen on the selection half and their claims tested on the held-out half
    units = massive_units(s.batch.tokens, ref.tolist(), cfg.seed)
    sel = units.prompts(units.select)
    scores = neuron_scores(s.model, s.batch, m, ref, dims, sel) if cfg.n_neurons else torch.zeros(0)
    top = scores.argsort(descending=True)[: cfg.n_neurons].tolist()
    svds = {mat: SVD.of(ffn_matrix(s.model, m, mat)) for mat in cfg.matrices}

    todo: list[tuple[Callable[..., Ablation], Callable]] = []  # (the row's fields, the edit)
    for mat in cfg.matrices:
        W, svd = ffn_matrix(s.model, m, mat), svds[mat]
        for e in edits.direction_plan(svd, cfg.sweep(), cfg.claim_k, cfg.n_random, cfg.seed):
            kind, d = "svd" if e.seed is None else "svd_random", e.directions
            row = partial(Ablation.measured, kind=kind, matrix=mat, k=len(d), directions=d)
            row = partial(row, scale=e.scale, energy=e.energy, seed=e.seed)
            todo.append((row, partial(edits.directions_removed, W, svd, d, e.scale)))
    for g in [[n] for n in top] + ([top] if len(top) > 1 else []):
        row = partial(Ablation.measured, kind="neurons", neurons=g)
        todo.append((row, partial(edits.neurons_ablated, s.model, m, g)))
    for i in range(cfg.n_random if top else 0):
        g = random_others(s.model.d_mlp, top, len(top), cfg.seed + i)
        row = partial(Ablation.measured, kind="neurons_random", neurons=g, seed=cfg.seed + i)
        todo.append((row, partial(edits.neurons_ablated, s.model, m, g)))
    rows = []
    s.reuse_from([m])  # every edit is in layer m's FFN
    for row, ctx in terminal.bar(todo, desc=NAME):
        with ctx():
            after = s.measure(start=m)
        rows.append(row(after, s.baseline, m))
    return Result(
        header=run_header(cfg, s.model, len(s.batch), s.site),
        baseline=s.baseline,
        rows=rows,
        singular_values=[Spectrum(mat, svds[mat].S[: max(cfg.sweep())].tolist()) for mat in svds],
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
    "c = (R_m(edited) − 1) / (R_m(unedited) − 1), R_m the ME layer's output norm ratio (mean "
    "over prompts)"
)
_DET = "; bootstrap over the distinct massive-token prefixes (edited and unedited means together)"
_HELD = (
    "; the neurons chosen on the selection half of the prompts (one unit per distinct "
    "massive-token prefix), the edit scored on the held-out half; bootstrap over held-out "
    "prompts (edited and unedited means together)"
)
_NO_MASSIVE = (
    "no massive activation at layer {} of the unedited model (the layer was given, not detected): "
    "there is nothing for the ablations to remove"
)
_SEEDS = (
    ", mean over the random draws (seeds); two-way (crossed) bootstrap over the distinct "
    "massive-token prefixes × seeds of R_m,b(edited) − 1 over R_m,b(unedited) − 1, the "
    "unedited excess resampled with its prompts"
)


def _massive(result: Result) -> str | None:
    return None if result.massive_at_layer else _NO_MASSIVE.format(result.layer)


def _removes(name, statement, section, control, row, missing, extra, held_out=False):
    """A claim that the edit ``row(result)`` removes the massive activation (``c ≤ removed``)."""

    def stat(result: Result) -> claims.Sample:
        if (r := row(result)) is None:
            raise claims.NotApplicable(f"not measured in this run: {missing}")
        base = result.baseline.prompt_ratio_at(result.layer)
        pairs = np.column_stack([r.ratio_at_layer_per_prompt, base])
        if not held_out:
            return claims.Sample(pairs, excess_stat)
        unit = "held-out prompts" if result.units.held_out else "prompts (nothing held out)"
        rows = result.neuron_prompts
        return claims.Sample(pairs[rows], excess_stat, unit=unit, prompts=rows)

    def details(result: Result) -> str:
        r, held, rows = row(result), "", result.neuron_prompts
        if held_out:  # the numbers the statistic is computed from: the held-out prompts' means
            before = np.asarray(result.baseline.prompt_ratio_at(result.layer))[rows].mean()
            after = np.asarray(r.ratio_at_layer_per_prompt)[rows].mean()
            held = (
                f"; the means c is computed from, on the {len(rows)} prompts tested (prompts "
                f"{rows}): R_m {fmt_value(before)} → {fmt_value(after)}"
            )
        return (
            f"{where_edited(result)}; {r.label()}: R_m after {fmt_value(r.ratio_at_layer)} (median "
            f"over all prompts){held}, survives {'yes' if r.survives else 'no'}; {extra(result)}"
        )

    what = (f"{NAME}.{name}", section, statement, _STAT + (_HELD if held_out else _DET), "<=")
    return claims.Spec(
        *what, "removed", control, stat=stat, applies=_massive, details=details, massive_state=True
    )


def _keeps(name, statement, section, control, kind, matrix, missing, extra, held_out=False):
    """The random control beside a removal claim: the drawn edits keep the activation."""

    def applies(result: Result) -> str | None:
        n, why = len(result.select(kind, matrix)), f"not measured in this run: {missing}"
        return _massive(result) or (claims.too_few_seeds(n, "--n-random") if n else why)

    def details(result: Result) -> str:
        rows = result.select(kind, matrix)
        return (
            f"{where_edited(result)}; c per seed {', '.join(fmt_value(r.change) for r in rows)}; "
            f"survives {sum(r.survives for r in rows)}/{len(rows)}; {extra(result)}"
        )

    def stat(r: Result) -> claims.Nested:
        return r.seed_measure(kind, matrix, r.neuron_prompts if held_out else None)

    what = (f"{NAME}.{name}", section, statement, _STAT + _SEEDS, ">", "removed", control)
    return claims.Spec(
        *what, kind="control", stat=stat, applies=applies, details=details, massive_state=True
    )


def _fmt_list(xs) -> str:
    return "[" + ", ".join(f"{x:.4g}" for x in xs) + "]"


def _svd_extra(mat: str, energy: bool = False) -> Callable[[Result], str]:
    def extra(result: Result) -> str:
        top, rand = result.svd_row(mat, result.claim_k), result.select("svd_random", mat)
        if not energy:
            sv = _fmt_list(result.spectrum(mat)[:3])
            return f"top singular values {sv}; smallest killing k {result.kill_k(mat)}"
        return (
            f"top-{result.claim_k} removal: c {fmt_value(top.change) if top else 'not run'}, energy "
            f"{fmt_value(top.energy if top else None)}; the others scaled "
            f"×{_fmt_list([r.scale for r in rand])} to energy {_fmt_list([r.energy for r in rand])}"
        )

    return extra


def _about_neurons(result: Result) -> str:
    u, dims = result.units, result.massive_dims[:4]
    where = f"on the selection half) by writes into dims {dims}; {u.text()}"
    if not u.held_out:
        where = (
            f"by writes into dims {dims}); every prompt has the same massive-token prefix, so the "
            "scores are one measurement and any half of the prompts picks the same neurons: chosen "
            f"and scored on all {result.n_prompts} prompts (c still varies by prompt through the "
            "other tokens' norms)"
        )
    return f"top neurons {result.neurons} (scores {_fmt_list(result.neuron_scores)}, {where}"


_NEURONS = "§2 claim 3 (a few FFN neurons)"
_OTHER_NEURONS = "as many other neurons (ffn_svd_ablation.random_neurons_keep)"
_NO_NEURON = "no neuron ablated (--n-neurons 0)"
SPECS: tuple[claims.Spec, ...] = (
    *(
        _removes(
            f"svd_{mat}_removes",
            f"Removing the top singular directions (k = claim_k) of the ME layer's W_{mat} removes "
            "the massive activation",
            "§2 claim 3 (the FFN creates it); §3 singular-direction ablation",
            f"as many other singular directions of W_{mat}, scaled to the same singular-value "
            f"energy (ffn_svd_ablation.svd_{mat}_random_keeps)",
            lambda r, mat=mat: r.svd_row(mat, r.claim_k),
            f"W_{mat} not ablated",
            _svd_extra(mat),
        )
        for mat in MATRICES
    ),
    *(
        _keeps(
            f"svd_{mat}_random_keeps",
            f"Subtracting as many other singular directions of W_{mat} (not the top k), scaled to "
            "remove as much singular-value energy as the top k, does not remove the massive "
            "activation",
            "§3 singular-direction ablation (control: other directions, matched energy)",
            f"the top-k directions (ffn_svd_ablation.svd_{mat}_removes)",
            "svd_random",
            mat,
            f"W_{mat} not ablated",
            _svd_extra(mat, energy=True),
        )
        for mat in MATRICES
    ),
    *(
        _removes(name, statement, _NEURONS, _OTHER_NEURONS, row, _NO_NEURON, _about_neurons, True)
        for name, statement, row in (
            (
                "top_neuron_removes",
                "Ablating the single FFN neuron of the ME layer that writes "
                "most into the massive dims removes the massive activation",
                lambda r: r.neurons_row(r.neurons[:1]),
            ),
            (
                "top_neurons_remove",
                "Ablating the top FFN neurons of the ME layer (by their writes "
                "into the massive dims) together removes the massive activation",
                lambda r: r.neurons_row(r.neurons),  # one neuron: the same row
            ),
        )
    ),
    _keeps(
        "random_neurons_keep",
        "Ablating as many FFN neurons of the ME layer drawn from the others does not remove the "
        "massive activation",
        "§2 claim 3 (control: other neurons)",
        "the top neurons (ffn_svd_ablation.top_neurons_remove)",
        "neurons_random",
        None,
        _NO_NEURON,
        lambda r: (
            f"{len(r.neurons)} neurons per draw; top score "
            f"{fmt_value(max(r.neuron_scores, default=None))}"
        ),
        held_out=True,
    ),
)
claims.check_specs(SPECS)


# ------------------------------------------------------------------------------------------
# figures and summary
# ------------------------------------------------------------------------------------------


def figures(result: Result) -> dict[str, go.Figure]:
    base, y = result.baseline.ratio_at(result.layer), "max token / mean others at the ME layer"
    head = f"Massive ratio at layer {result.layer} after"
    tail = f"— {result.model}<br><sup>dashed: the unedited model ({base:.3g})</sup>"
    names = {"svd": "top k", "svd_random": "k others, same energy (seeds)"}
    series = {
        f"W_{mat}: {name}": ([r.k for r in rows], [r.ratio_at_layer for r in rows])
        for mat, (kind, name) in product(MATRICES, names.items())
        if (rows := result.select(kind, mat))
    }
    seeds = [n for n in series if n.endswith(names["svd_random"])]
    svd = plotting.lines(
        series, f"{head} removing singular directions {tail}", "k", y, base, seeds, True
    )
    nrows = result.select("neurons") + result.select("neurons_random")
    neu = plotting.bars(
        {r.label(): r.ratio_at_layer for r in nrows},
        f"{head} ablating FFN neurons (top by writes into dims {result.massive_dims[:4]}, then "
        f"random others; green: still massive, red: gone) {tail}",
        y,
        base,
        ["seagreen" if r.survives else "firebrick" for r in nrows],
        xaxis_title="ablated neurons",
    )
    return {"svd_sweep": svd, "neuron_ablation": neu}


def summary(result: Result) -> str:
    rows = [(r.kind, r.matrix or "-", r.label(), *r.cells(), r.change) for r in result.rows]
    return (
        f"model: {result.model}   ME layer {result.layer} (1-based {result.layer + 1})   unedited "
        f"ratio {result.baseline.ratio_at(result.layer):.4g}   {result.n_prompts} prompts   top "
        f"neurons {result.neurons}\n\n"
        + fmt_table(["edit", "matrix", "what", *EDIT_COLUMNS, "c"], rows)
    )


EXPERIMENT = Experiment(
    NAME,
    Config,
    run,
    SPECS,
    figures,
    summary,
    __doc__,
    key_figures=("svd_sweep",),
    inputs=weights.inputs,
)
main = command(EXPERIMENT)


if __name__ == "__main__":
    raise SystemExit(main())
