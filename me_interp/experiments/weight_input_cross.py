"""Weights × input cross: does the ME layer's RMSNorm–FFN pair make the massive output from any input?

Swapping the ME layer's pre-FFN norm + FFN into another layer (``weight_swap``) moves the emergence
only to some depths. Either the weights alone decide (paper.md §2.3) and the swap fails elsewhere
for another reason, or the *input* at that depth matters too (the "pre-existing directional
tendency" the FFN amplifies, §2.6). This experiment separates the two without any edit, from **one**
forward pass of the unedited model: every layer ``X``'s FFN path fed every layer ``Y``'s input of the
massive token, ``C_b[X, Y]`` (:mod:`me_interp.probes.cross`; on a sandwich-norm model the path ends
with the post-FFN norm: on Gemma-3-270m layer 0's FFN output before it is only 1.2–1.6× the other
tokens', and the 17× ratio appears through the post-FFN norm's gain).

A cell is *large* when ``C_b[X, Y] ≥ max(k, r · C_b[m, m])`` (``k``: threshold :data:`LARGE_KEY`,
``r``: ``cross_keep``), and counts for the claims when it is large on more than half of the prompts
(:meth:`Result.majority_large`). Inputs ``Y ≤ m`` come before the emergence and are judged; later
columns already carry the massive activation and are shown only. The paper predicts large cells only
in row ``m``, for every earlier input; "the input matters" predicts a band of inputs near ``m``.

    python -m me_interp.experiments.weight_input_cross
    python -m me_interp.experiments.weight_input_cross --model synthetic:planted
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go
import torch

from me_interp import claims, plotting
from me_interp.architecture import FFN_RESIDUAL_SITE
from me_interp.edits.core import moved_modules
from me_interp.loading.loaded import LoadedModel
from me_interp.probes.batching import ResidMidRecorder
from me_interp.probes.cross import (
    PromptStats,
    breadth_outcomes,
    cross_matrices,
    prompt_statistics,
    share_outcomes,
)
from me_interp.probes.measurement import SCAN_SITES, short_batch
from me_interp.probes.site import Site
from me_interp.study.cli import command
from me_interp.study.config import CriterionConfig, checked
from me_interp.study.experiment import Experiment, Inputs, prepare, scanned_inputs
from me_interp.study.result import Headed, RunHeader, run_header
from me_interp.terminal import fmt_table

NAME = "weight_input_cross"
LARGE_KEY = "cross_large"
"""The threshold key of the large-cell factor ``k``."""
FFN_SITE = FFN_RESIDUAL_SITE
"""The site ``F_X(resid_mid_X)`` reproduces and the denominator reads: the FFN's residual contribution."""


@dataclass(frozen=True)
class Config(CriterionConfig):
    """Weights × input cross settings.

    Attributes:
        layer: the row to test, the ME layer ``m`` (0-based); ``None`` = the detected ME layer (a
            model without one is then "not applicable").
        n_prompts: how many prompts, spread evenly over the set (``0`` = all).
        max_tokens: cut every prompt to its first ``max_tokens`` tokens (the massive token is among
            the first; the others give the normalising median; ``0`` = no cut). One forward pass
            keeps ``resid_mid`` of every layer, so memory grows with ``n_prompts × max_tokens``.
    """

    layer: int | None = checked(None, ge=0)
    n_prompts: int = checked(0, ge=0)
    max_tokens: int = checked(64, ge=2, also=(0,))


@dataclass(frozen=True)
class Result(Headed):
    """What :func:`run` measured (0-based layers; ``header.layer`` is the tested row ``m``).

    Attributes:
        positions: per prompt, the massive token ``p_b``; ``prompt_lengths``: its token count.
        cross: ``[prompt][X][Y]`` the matrices ``C_b`` (:mod:`me_interp.probes.cross`).
        large_factor: ``k``; ``large_fraction``: ``r``, the fraction of ``C_b[m, m]`` a large cell
            keeps. ``stats``: the per-prompt statistics of the cross for row ``m``.
        path_modules: the HF modules (within a decoder layer) of the FFN path ``F_X``, in order.
    """

    header: RunHeader
    n_layers: int
    positions: list[int]
    prompt_lengths: list[int]
    cross: list[list[list[float]]]
    large_factor: float
    large_fraction: float
    stats: PromptStats
    path_modules: list[str]

    @property
    def layer(self) -> int:
        assert self.header.layer is not None  # run raises NotApplicable otherwise
        return self.header.layer

    @property
    def n_prompts(self) -> int:
        return len(self.cross)

    def matrix(self) -> np.ndarray:
        """``[X, Y]`` the median over prompts of ``C_b``."""
        return np.median(np.asarray(self.cross), axis=0)

    def majority_large(self) -> np.ndarray:
        """``[X, Y]`` whether the cell is large on more than half of the prompts (the claims)."""
        return 2 * np.asarray(self.stats.large_count) > self.n_prompts

    def breadth_outcomes(self) -> claims.Outcomes:
        """Per earlier input layer ``Y < m``: is the cell ``(m, Y)`` large (majority)."""
        return breadth_outcomes(self.majority_large(), self.layer)

    def share_outcomes(self) -> claims.Outcomes:
        """Per large cell (majority) among inputs ``Y ≤ m``, ``(m, m)`` left out: is it in row ``m``."""
        return share_outcomes(self.majority_large(), self.layer)

    def majority_cells(self, max_input: int | None = None) -> list[tuple[int, int]]:
        """Cells ``(X, Y)`` large on a majority of the prompts (inputs ``Y ≤ max_input``)."""
        xs, ys = np.nonzero(self.majority_large())
        return [(int(x), int(y)) for x, y in zip(xs, ys) if max_input is None or y <= max_input]

    def large_cells(self) -> list[tuple[int, int]]:
        """Cells ``(X, Y)`` of :meth:`matrix` that are large (by its own ``C[m, m]``)."""
        med = self.matrix()
        thr = max(self.large_factor, self.large_fraction * med[self.layer, self.layer])
        xs, ys = np.nonzero(med >= thr)
        return [(int(x), int(y)) for x, y in zip(xs, ys)]


def result_of(
    header: RunHeader,
    n_layers: int,
    positions: list[int],
    lengths: list[int],
    cross: list[list[list[float]]],
    k: float,
    r: float,
    path_modules: list[str] | None = None,
) -> Result:
    """The :class:`Result` of cross matrices ``cross`` for row ``header.layer`` (its statistics
    computed here)."""
    assert header.layer is not None
    stats = prompt_statistics(np.asarray(cross), header.layer, k, r)
    return Result(header, n_layers, positions, lengths, cross, k, r, stats, path_modules or [])


def inputs(cfg: Config, model: LoadedModel) -> Inputs:
    """The prompts and one forward pass: their norm scan (the FFN's own output too) and every
    layer's ``resid_mid`` (``made``)."""
    if cfg.layer is not None:
        model.check_layer(cfg.layer)  # before the forward
    batch = short_batch(model, cfg.load_prompts(), cfg.n_prompts, cfg.max_tokens)
    resid = ResidMidRecorder(model, batch)
    return scanned_inputs(model, batch, resid, sites=(*SCAN_SITES, FFN_SITE))


def run(cfg: Config, model: LoadedModel | None = None, site: Site | None = None) -> Result:
    """One forward pass, then the cross of every layer's FFN path with every layer's input.

    Raises:
        NotApplicable: no massive activation on the model and no ``cfg.layer``.
        ValueError: ``cfg.layer`` out of range.
    """
    model, site = prepare(EXPERIMENT, cfg, model, site)
    batch, scan, (resid,) = site.batch, site.scan, site.inputs.made
    site.require("pass --layer to test a layer anyway")
    positions = torch.tensor(site.reference)
    cross = cross_matrices(model, resid.out, scan.site_norms(FFN_SITE), scan.mask, positions)
    header = run_header(cfg, model, len(batch), site)
    return result_of(
        header,
        model.n_layers,
        positions.tolist(),
        batch.lengths,
        cross.tolist(),
        claims.threshold(LARGE_KEY),
        claims.threshold("cross_keep"),
        moved_modules(model, "ffn_path"),
    )


def _details(result: Result) -> str:
    m = result.layer
    med = result.matrix()
    return (
        f"m = {m} (1-based {m + 1}, {'--layer' if result.header.layer_given else 'detected'}; "
        f"detected ME layer {result.header.me_layer}); median-over-prompts row m for Y ≤ m: "
        + ", ".join(f"{v:.3g}" for v in med[m, : m + 1])
        + f"; large = C_b ≥ max(k = {result.large_factor:g} ('{LARGE_KEY}'), r = "
        f"{result.large_fraction:g} ('cross_keep') × C_b[m, m]); cells large on a majority of the "
        f"{result.n_prompts} prompts (Y ≤ m): {result.majority_cells(m)}; of the median matrix: "
        f"{[c for c in result.large_cells() if c[1] <= m]}"
    )


_MAJORITY = "a cell is large when C_b ≥ max(k, r·C_b[m, m]) on more than half of the prompts"

SPECS: tuple[claims.Spec, ...] = (
    claims.Spec(
        f"{NAME}.row_share",
        "§2.3, §3",
        "Only the ME layer's pre-FFN RMSNorm + FFN turn the massive token's pre-emergence state into "
        "a massive FFN output: the large cells of the weights × input cross lie in the ME layer's row",
        f"of the large cells among inputs Y ≤ m (cell (m, m) left out), the fraction in row X = m "
        f"({_MAJORITY}; k of n large cells, Clopper–Pearson)",
        ">=",
        "cross_share",
        "the same inputs through every other layer's pre-FFN norm + FFN (the other rows)",
        stat=lambda r: r.share_outcomes(),
        unit="large cells",
        details=_details,
    ),
    claims.Spec(
        f"{NAME}.row_breadth",
        "§2.3 vs §2.6",
        "The ME layer's pre-FFN RMSNorm + FFN make the massive output from the massive token's state "
        "at any earlier depth, not only from the input it gets at its own depth",
        f"of the earlier input layers Y < m, the fraction whose cell (m, Y) is large ({_MAJORITY}; "
        "k of n input layers, Clopper–Pearson: the layers are the depths there are, not a sample)",
        ">=",
        "cross_breadth",
        "the observed input Y = m (left out); weight_swap.ffn_path, which moves the same weights",
        stat=lambda r: r.breadth_outcomes(),
        unit="earlier input layers",
        details=_details,
    ),
    claims.Spec(
        f"{NAME}.diagonal",
        "§2.1",
        "The ME layer's FFN output on the massive token is large on its own input",
        "per prompt, C[m, m]: the ME layer's actual FFN residual contribution (ffn_out, after any "
        "post-FFN norm) on the massive token over the median of the other tokens'; mean over prompts",
        ">=",
        LARGE_KEY,
        "true by the detection rule (the ME layer is where the FFN makes the norm jump)",
        kind="sanity",
        stat=lambda r: claims.Sample(r.stats.diagonal),
        unit="prompts",
        details=_details,
    ),
)
SPEC = claims.index(SPECS)


def _path_text(result: Result) -> str:
    return " → ".join(result.path_modules) if result.path_modules else "FFN path"


def figures(result: Result) -> dict[str, go.Figure]:
    L, m, path, n = result.n_layers, result.layer, _path_text(result), result.n_prompts
    k, r = result.large_factor, result.large_fraction
    fig = plotting.log_heatmap(
        result.matrix().tolist(),
        f"Weights × input cross: ‖F_X(resid_mid_Y)‖ of the massive token over the other tokens' "
        f"median FFN contribution (ffn_out) at X — {result.model}<br><sup>F_X = layer X's {path}; "
        f"median over {n} prompts; row X = {m} boxed; large = C ≥ max({k:g}, {r:g} × C[{m}, {m}])"
        "</sup>",
        "input: resid_mid of layer Y (0-based)",
        "weights: FFN path of layer X (0-based)",
        "weights of layer %{y}, input of layer %{x}<br>C = %{customdata:.4g}",
    )
    box = {"color": "deepskyblue", "width": 2}
    fig.add_shape(type="rect", x0=-0.5, x1=L - 0.5, y0=m - 0.5, y1=m + 0.5, line=box)
    fig.add_vline(
        x=m + 0.5,
        line_dash="dash",
        line_color="deepskyblue",
        annotation_text=f"ME layer {m} (1-based {m + 1}): inputs ≤ {m} are judged",
        annotation_position="top left",
    )
    cross = np.asarray(result.cross)
    thr = float(np.median(result.stats.threshold))
    fig_row = plotting.quartile_lines(
        range(L),
        {
            f"row X = {m} (ME layer)": cross[:, m, :],  # [prompt Y]
            "largest other row": np.delete(cross, m, axis=1).max(axis=1),
        },
        f"The ME layer's FFN path fed the massive token's state of every layer — {result.model}"
        f"<br><sup>{path}; median and interquartile range over {n} prompts; dotted: large "
        f"(median threshold {thr:.3g})</sup>",
        "input: resid_mid of layer Y (0-based)",
        "C (massive-token FFN contribution / others' median)",
    )
    # no annotation on the line: on a log axis plotly reads an annotation's y as log10(y)
    fig_row.add_hline(y=thr, line_dash="dot")
    fig_row.add_vline(
        x=m, line_dash="dash", line_color="firebrick", annotation_text=f"ME layer {m}"
    )
    return {"cross_matrix": fig, "me_row": fig_row}


def summary(result: Result) -> str:
    m, med = result.layer, result.matrix()
    cols = sorted({0, max(m - 2, 0), max(m - 1, 0), m, min(m + 1, result.n_layers - 1)})
    rows = sorted({m, *(x for x, _ in result.large_cells())})
    table = fmt_table(
        ["X \\ Y", *(str(y) for y in cols)],
        [(str(x), *(float(med[x, y]) for y in cols)) for x in rows],
    )
    return "\n".join(
        [
            f"model: {result.model}   tested row m = {m} (1-based {m + 1})   detected ME layer "
            f"{result.header.me_layer}   prompts {result.n_prompts}",
            f"FFN path F_X: {_path_text(result)} (denominator: the other tokens' {FFN_SITE})",
            "",
            "median over prompts of C[X, Y] (rows: row m and the rows with a large cell):",
            table,
        ]
    )


# attention="sdpa": it reads no attention pattern (the fused kernel, me_interp.loading.attention)
EXPERIMENT = Experiment(
    NAME,
    Config,
    run,
    SPECS,
    figures,
    summary,
    __doc__,
    attention="sdpa",
    key_figures=("cross_matrix",),
    inputs=inputs,
)
main = command(EXPERIMENT)


if __name__ == "__main__":
    raise SystemExit(main())
