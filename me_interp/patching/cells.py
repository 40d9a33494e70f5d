"""A patching sweep as a typed, serialisable record, with its bootstrap over prompts (or pairs).

:class:`Cells` holds what :class:`me_interp.patching.SweepResult` measured — per metric, the clean
and corrupt runs' values and every patched cell's values, per prompt — as plain lists, so a Result
that embeds it is written to JSON and read back by :mod:`me_interp.io` (``to_jsonable`` /
``from_jsonable``) with no ``to_dict``. A cell's normalised value is ARENA's
``(mean patched − mean corrupt) / (mean clean − mean corrupt)`` (clean = 1, corrupt = 0), on all the
prompts or on a subset (:meth:`Cells.normalized` with ``rows``); :meth:`Cells.bootstrap` gives its
percentile interval, each resample drawing the prompts with replacement and recomputing the three
means on the same draw. :func:`separation` asks whether a metric separates clean from corrupt at all
beyond that noise (if not, every normalised value divides by noise).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from me_interp import claims
from me_interp.patching.sweep import SweepResult


@dataclass(frozen=True)
class MetricCells:
    """One metric of a sweep, per prompt: ``clean`` and ``corrupt`` ``[prompt]``, ``patched``
    ``[cell][prompt]`` (cells in the row-major order of the sweep's grid)."""

    metric: str
    clean: list[float]
    corrupt: list[float]
    patched: list[list[float]]


@dataclass(frozen=True)
class Cells:
    """A sweep of one ``site`` over ``layers`` × ``positions`` (``None``: every cell patches all
    positions) × ``heads`` (``None``: not a per-head site), with its per-prompt values.

    Attributes:
        metrics: one :class:`MetricCells` per metric read.
        n_forwards: patched forwards run; ``method``: ``exact`` or ``attribution``.
    """

    site: str
    layers: list[int]
    positions: list[int] | None
    heads: list[int] | None
    metrics: list[MetricCells]
    n_forwards: int = 0
    method: str = "exact"

    @classmethod
    def of(cls, sw: SweepResult) -> Cells:
        """The record of a finished sweep."""
        names = list(sw.values)
        return cls(
            sw.site,
            list(sw.layers),
            None if sw.positions is None else list(sw.positions),
            None if sw.heads is None else list(sw.heads),
            [
                MetricCells(
                    m,
                    sw.clean[m].double().cpu().tolist(),
                    sw.corrupt[m].double().cpu().tolist(),
                    sw.values[m].double().cpu().reshape(-1, sw.clean[m].numel()).tolist(),
                )
                for m in names
            ],
            sw.n_forwards,
            sw.method,
        )

    @property
    def metric_names(self) -> list[str]:
        return [m.metric for m in self.metrics]

    @property
    def axes(self) -> tuple[str, ...]:
        pos, head = self.positions is not None, self.heads is not None
        return ("layer", *(("pos",) if pos else ()), *(("head",) if head else ()))

    @property
    def shape(self) -> tuple[int, ...]:
        extra = [len(a) for a in (self.positions, self.heads) if a is not None]
        return (len(self.layers), *extra)

    def metric(self, name: str) -> MetricCells | None:
        return next((m for m in self.metrics if m.metric == name), None)

    def values(self, metric: str) -> np.ndarray:
        """``[cell, prompt]`` patched values (cells flat)."""
        return np.asarray(self.metric(metric).patched, dtype=np.float64)

    def at(self, layer: int, pos: int | None = None, head: int | None = None) -> int | None:
        """The flat index of cell ``(layer, pos, head)``; ``None`` when it was not swept."""
        idx, axes = [], [(self.layers, layer), (self.positions, pos), (self.heads, head)]
        for values, v in axes:
            if values is not None:
                if v not in values:
                    return None
                idx.append(values.index(v))
        return int(np.ravel_multi_index(idx, self.shape))

    def rows(self, metric: str, cells: Sequence[int]) -> np.ndarray:
        """Per prompt ``[clean, corrupt, patched at each flat cell of cells]``."""
        m = self.metric(metric)
        return np.column_stack([m.clean, m.corrupt, *(m.patched[c] for c in cells)])

    def normalized(self, metric: str, rows: Sequence[int] | None = None) -> np.ndarray:
        """The normalised value of every cell, shaped like the grid, on the prompts ``rows``
        (``None``: all); NaN where clean and corrupt coincide."""
        m = self.metric(metric)
        pick = slice(None) if rows is None else np.asarray(rows, dtype=int)
        c, x = np.mean(np.asarray(m.clean)[pick]), np.mean(np.asarray(m.corrupt)[pick])
        p = self.values(metric)[:, pick].mean(1)
        return claims.divide(p - x, np.full_like(p, c - x)).reshape(self.shape)

    def bootstrap(
        self, metric: str, seed: int, rows: Sequence[int] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Percentile interval (``claims.LEVEL``) of every cell's normalised value over the prompts
        ``rows`` (``None``: all), ``claims.N_BOOTSTRAP`` resamples: ``(lo, hi)`` shaped like the
        grid."""
        m = self.metric(metric)
        pick = np.arange(len(m.clean)) if rows is None else np.asarray(rows, dtype=int)
        w = _weights(len(pick), seed)  # [N pick]
        clean = w @ np.asarray(m.clean)[pick]
        corrupt = w @ np.asarray(m.corrupt)[pick]
        patched = self.values(metric)[:, pick] @ w.T  # [cells N]
        boot = claims.divide(patched - corrupt, np.broadcast_to(clean - corrupt, patched.shape))
        alpha = (1 - claims.LEVEL) / 2
        lo = np.full(len(patched), np.nan)
        hi = lo.copy()
        ok = np.isfinite(boot).any(1)
        if ok.any():
            lo[ok], hi[ok] = np.nanquantile(boot[ok], [alpha, 1 - alpha], axis=1)
        return lo.reshape(self.shape), hi.reshape(self.shape)

    def largest(
        self, metric: str, tokens: Sequence[str], position: int | None = None
    ) -> tuple[float, str]:
        """The largest normalised value and the :meth:`label` of its cell; with ``position``, of
        the cells at that position only (a per-position, not a per-head, sweep)."""
        grid = self.normalized(metric)
        if position is not None and self.heads is None:
            assert self.positions is not None
            grid[:, np.arange(grid.shape[1]) != self.positions.index(position)] = np.nan
        flat = int(np.nanargmax(np.where(np.isfinite(grid), grid, -np.inf)))
        return float(grid.ravel()[flat]), self.label(flat, tokens)

    def label(self, flat: int, tokens: Sequence[str]) -> str:
        """``L3 p5 'John' h7``-style name of flat cell ``flat`` (``tokens`` label positions)."""
        at = np.unravel_index(flat, self.shape)
        parts, k = [f"L{self.layers[at[0]]}"], 1
        if self.positions is not None:
            p = self.positions[at[k]]
            parts.append(f"p{p} {tokens[p]!r}" if p < len(tokens) else f"p{p}")
            k += 1
        if self.heads is not None:
            parts.append(f"h{self.heads[at[k]]}")
        return " ".join(parts)


@claims.of_means
def restore_stat(m: np.ndarray) -> np.ndarray | float:
    """Columns ``[clean, corrupt, patched_1 … patched_k]`` → the largest normalised value
    (clean = 1, corrupt = 0) over the cells, of the column means ``m``."""
    denom = m[..., 0] - m[..., 1]
    return np.max(claims.divide(m[..., 2:] - m[..., 1:2], denom[..., None]), axis=-1)


def columns(
    sweeps: Sequence[Cells],
    cells: Sequence[tuple[str, int, int]],
    metric: str,
    aliases: Sequence[Sequence[str]] = (),
) -> np.ndarray | None:
    """Per prompt ``[clean, corrupt, patched at each (site, layer, position) of cells]`` from the
    sweeps (a site of ``aliases`` finds any sweep of its group); ``None`` when a cell or the metric
    was not swept."""
    found = []
    for site, layer, pos in cells:
        group = next((a for a in aliases if site in a), (site,))
        sw = next((c for c in sweeps if c.site in group and c.metric(metric) is not None), None)
        at = None if sw is None else sw.at(layer, pos)
        if at is None:
            return None
        found.append(sw.metric(metric).patched[at])
    if not found:
        return None
    m = next(c for c in sweeps if c.metric(metric) is not None).metric(metric)
    return np.column_stack([m.clean, m.corrupt, *found]).astype(np.float64)


def cells_sample(
    rows: np.ndarray | None, cells: Sequence[tuple[str, int, int]], metric: str
) -> claims.Sample:
    """The :class:`~me_interp.claims.Sample` of a claim decided by ``cells``: per prompt ``rows``
    ``[clean, corrupt, patched …]`` (:func:`columns`), the largest normalised value over the cells
    (:func:`restore_stat`); ``NotApplicable`` when ``rows`` is ``None`` (not swept)."""
    if rows is None:
        shown = ", ".join(f"{c} at layer {x}" for c, x, _ in cells[:3])
        raise claims.NotApplicable(
            f"the cells it needs ({shown}{', …' if len(cells) > 3 else ''}; metric {metric}) "
            "were not swept (see --sites)"
        )
    return claims.Sample(rows, restore_stat)


OVERSHOOT = 1 + 1e-6
"""A normalised value above this (1 up to float noise) is an overshoot, not a restore."""


def cells_text(m: np.ndarray, cells: Sequence[tuple[str, int, int]]) -> str:
    """What the prompt means ``m`` ``[clean, corrupt, patched at each of cells]`` say, each part
    after ``"; "``: with several cells, the largest normalised value and the most negative one (one
    at ``−restore`` or below erases the clean value); an overshoot above 1 (not a restore)."""
    out = ""
    norm = (m[2:] - m[1]) / (m[0] - m[1]) if m[0] != m[1] else np.full(len(m) - 2, np.nan)
    if len(cells) > 1 and np.isfinite(norm).any():
        hi, lo = int(np.nanargmax(norm)), int(np.nanargmin(norm))
        out += f"; largest {norm[hi]:.3g} at {cells[hi][0]} of layer {cells[hi][1]}"
        if norm[lo] < 0:
            out += f"; most negative {norm[lo]:.3g} at {cells[lo][0]} of layer {cells[lo][1]}"
            if norm[lo] <= -claims.threshold("restore"):
                out += " (it writes against the massive direction: it erases it)"
    best = float(np.nanmax(norm)) if np.isfinite(norm).any() else float("nan")
    if best > OVERSHOOT:
        out += (
            f"; overshoot: {best:.3g} > 1 — the patched run has more along the massive direction "
            "than the clean run, which is not a restore"
        )
    return out


TOP = 5
"""How many top cells of each site :func:`top_cells` chooses and reports."""


@dataclass(frozen=True)
class TopCell:
    """A top cell: chosen by ``|normalised|`` on the selection pairs (``selected``), reported on
    the held-out pairs (``normalised``, interval ``lo``..``hi``)."""

    site: str
    cell: str
    flat: int
    selected: float
    normalised: float
    lo: float
    hi: float


def top_cells(
    sweeps: Sequence[Cells], metric: str, select: list[int], test: list[int], tokens, seed: int
) -> tuple[list[TopCell], int]:
    """Each sweep's :data:`TOP` cells by ``|normalised|`` on the pairs ``select``, with their value
    and interval on the pairs ``test``; and the number of finite cells searched."""
    out, searched = [], 0
    for c in sweeps:
        chosen = c.normalized(metric, select).ravel()
        ok = np.flatnonzero(np.isfinite(chosen))
        searched += len(ok)
        best = ok[np.argsort(-np.abs(chosen[ok]), kind="stable")][:TOP]
        held = c.normalized(metric, test).ravel()
        lo, hi = (g.ravel() for g in c.bootstrap(metric, seed, test))
        out += [
            TopCell(c.site, c.label(int(i), tokens), int(i), chosen[i], held[i], lo[i], hi[i])
            for i in best
        ]
    return out, searched


def _weights(n: int, seed: int) -> np.ndarray:
    """``[N_BOOTSTRAP, n]`` resample weights: each row the counts of a draw with replacement / n."""
    idx = np.random.default_rng(seed).integers(0, n, size=(claims.N_BOOTSTRAP, n))
    w = np.zeros((claims.N_BOOTSTRAP, n))
    np.add.at(w, (np.arange(claims.N_BOOTSTRAP)[:, None], idx), 1.0 / n)
    return w


@dataclass(frozen=True)
class Separation:
    """Whether a metric separates clean from corrupt: the mean difference ``clean − corrupt`` over
    the prompts and its percentile interval (paired resampling); it separates when the interval
    excludes 0."""

    clean: float
    corrupt: float
    difference: float
    lo: float
    hi: float
    n: int

    @property
    def separates(self) -> bool:
        return bool(self.lo > 0 or self.hi < 0)

    def text(self, metric: str) -> str:
        return (
            f"metric {metric}: clean {self.clean:.4g}, corrupt {self.corrupt:.4g}, difference "
            f"{self.difference:.3g} [{self.lo:.3g}, {self.hi:.3g}] ({claims.LEVEL:.0%} bootstrap "
            f"over {self.n} pairs)"
        )


def separation(clean: Sequence[float], corrupt: Sequence[float], seed: int) -> Separation:
    """The :class:`Separation` of per-prompt ``clean`` and ``corrupt`` values."""
    c, x = np.asarray(clean, dtype=np.float64), np.asarray(corrupt, dtype=np.float64)
    boot = _weights(len(c), seed) @ (c - x)
    alpha = (1 - claims.LEVEL) / 2
    lo, hi = np.quantile(boot, [alpha, 1 - alpha])
    return Separation(
        float(c.mean()), float(x.mean()), float((c - x).mean()), float(lo), float(hi), len(c)
    )
