"""Weights × input cross: does the ME layer's RMSNorm–FFN pair make the massive output from any input?

Swapping the ME layer's pre-FFN norm + FFN into another layer (``weight_swap``) moves the emergence
only to some depths. Either the weights alone decide (paper.md §2.3: the RMSNorm–FFN pair creates the
activation) and the swap fails elsewhere for another reason, or the *input* at that depth matters too
(the "pre-existing directional tendency" the FFN amplifies, §2.6). This experiment separates the two
without any edit, from **one** forward pass of the unedited model.

For prompt ``b`` with massive token ``p_b`` (the detected massive position at the ME layer ``m``; 0
when the prompt has none), every weights layer ``X`` and every input layer ``Y``:

    r_{Y,b}      = resid_mid of layer Y at p_b           (the FFN-path input, before the norm)
    F_X(h)       = PostNorm_ffn,X(FFN_X(RMSNorm_ffn,X(h))) (layer X's own modules, gains included)
    C_b[X, Y]    = ‖F_X(r_{Y,b})‖ / median_{t ≠ p_b} ‖F_X(r_{X,b,t})‖

``F_X`` is layer ``X``'s whole FFN path (``edits`` part ``ffn_path``), from the residual stream back
into it: on a sandwich-norm model (Gemma 2/3) it ends with the post-FFN norm, elsewhere there is none
and ``F_X(h) = FFN_X(RMSNorm_ffn,X(h))``. So ``F_X(r_{X,b,t})`` is the FFN's *residual contribution*
``hook_mlp_out`` (site ``ffn_out``), and the denominator is its typical norm over the prompt's *other*
tokens at layer ``X`` (read from the actual forward): ``C ≈ 1`` is "an ordinary FFN contribution" and
the diagonal ``C_b[X, X]`` is the actual massive-token ratio of layer ``X``'s ``ffn_out``. (The
post-FFN norm must be in the path: on Gemma-3-270m layer 0's FFN output before it is only 1.2–1.6×
the other tokens', and the 17× ratio appears through the post-FFN norm's gain.) A cell is *large* when

    C_b[X, Y] ≥ max(k, r · C_b[m, m])

i.e. the FFN output is outsized (``k`` times an ordinary one; ``k`` = the threshold :data:`LARGE_KEY`)
*and* keeps at least the fraction ``r`` of the massive output the ME layer actually makes (``r`` = the
``cross_keep`` threshold). Inputs
``Y ≤ m`` come before the emergence; from ``Y > m`` on the input already carries the massive
activation (its normalised direction is a spike on the massive dims), so those columns are shown but
not judged.

Predictions on the judged region (columns ``Y ≤ m``, the observed cell ``(m, m)`` left out): the paper
predicts large cells only in row ``X = m``, for every earlier input ``Y < m``; "the input matters"
predicts large cells in a band of inputs ``Y`` near ``m`` — across rows, or in row ``m`` only there.

A cell counts as large for the claims when it is large on more than half of the prompts (a
majority, :meth:`Result.majority_large`): the claims are about layers (rows X, inputs Y), and the
prompts only decide each cell. Claims (:data:`SPECS`, declarative, judged by
:func:`me_interp.claims.judge`):

* ``weight_input_cross.row_share`` (claim) — of the large cells in the judged region, how many lie
  in row ``m``: k of n large cells with an exact (Clopper–Pearson) interval, each cell listed; holds
  when the interval is ``≥`` ``cross_share``; not applicable when no cell of the region is large
  (then ``row_breadth`` fails: nothing is made from an earlier input);
* ``weight_input_cross.row_breadth`` (claim) — of the earlier inputs ``Y < m``, how many make a large
  cell ``(m, Y)``: k of n input layers (Clopper–Pearson), each listed by its depth relative to ``m``
  (``"layer 3 (m-8)"``); holds when ``≥`` ``cross_breadth`` (the forward-free analogue of
  ``weight_swap``'s moved fraction: layer ``m``'s FFN path fed another depth's input);
* ``weight_input_cross.diagonal`` (sanity: true by the detection rule) — ``C_b[m, m]``, the ME
  layer's actual massive-token FFN contribution (``ffn_out``) over the others', a mean over prompts
  with a bootstrap interval over prompts (each prompt's own denominator); holds when ``≥ k``.

With few layers the k-of-n intervals are wide (2 of 2 give [0.16, 1]); at least 6 units are needed
to decide against a threshold of 0.5 either way.

A model without a massive activation is "not applicable" unless ``--layer`` is given; an ME layer 0
has no earlier input, so its row claims are "not applicable".

    python -m me_interp.experiments.weight_input_cross
    python -m me_interp.experiments.weight_input_cross --model synthetic:planted
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, get_args

import numpy as np
import plotly.graph_objects as go
import torch
from jaxtyping import Bool, Float, Int

from me_interp import claims
from me_interp.architecture import FFN_RESIDUAL_SITE
from me_interp.edits.core import moved_modules, part_members, part_module
from me_interp.experiments._weights import (
    SCAN_SITES,
    depth_label,
    short_batch,
)
from me_interp.loading.loaded import LoadedModel
from me_interp.probes.batching import ResidMidRecorder, record
from me_interp.probes.massive import Criterion, CriterionKind
from me_interp.probes.norms import NormRecorder
from me_interp.probes.site import locate
from me_interp.study import (
    INDEX_CONVENTION,
    CommonConfig,
    Experiment,
    checked,
    command,
    model_for,
)
from me_interp.terminal import fmt_table

NAME = "weight_input_cross"
LARGE_KEY = "cross_large"
"""The threshold key of the large-cell factor ``k``."""
FFN_SITE = FFN_RESIDUAL_SITE
"""The site ``F_X(resid_mid_X)`` reproduces and the denominator reads: the FFN's residual contribution."""


@dataclass(frozen=True)
class Config(CommonConfig):
    """Weights × input cross settings.

    Attributes:
        layer: the row to test, the ME layer ``m`` (0-based); ``None`` = the detected ME layer (a
            model without one is then "not applicable").
        n_prompts: how many prompts, spread evenly over the set (``0`` = all).
        max_tokens: cut every prompt to its first ``max_tokens`` tokens (the massive token is among
            the first; the others give the normalising median; ``0`` = no cut). One forward pass
            keeps ``resid_mid`` of every layer, so memory grows with ``n_prompts × max_tokens``.
        criterion: massive-activation criterion (``sun``: value thresholds; ``norm``: token-norm
            ratio).
    """

    layer: int | None = checked(None, ge=0)
    n_prompts: int = checked(0, ge=0)
    max_tokens: int = checked(64, ge=2, also=(0,))
    criterion: str = checked("sun", choices=get_args(CriterionKind))


@dataclass
class Result:
    """What :func:`run` measured (0-based layers).

    Attributes:
        layer: the tested row ``m``; ``layer_given``: from ``--layer`` (else the detected ME layer).
        me_layer: the ME layer detected on these prompts (``None``: none).
        positions: per prompt, the massive token ``p_b``.
        cross: ``[prompt][X][Y]`` the matrices ``C_b`` (see the module docstring).
        large_factor: ``k``, the large-cell factor; ``large_fraction``: ``r``, the fraction of
            ``C_b[m, m]`` a large cell keeps.
        path_modules: the HF modules (within a decoder layer) of the FFN path ``F_X``, in order.
    """

    model: str
    bos: str
    layer: int
    layer_given: bool
    me_layer: int | None
    n_layers: int
    positions: list[int]
    prompt_lengths: list[int]
    cross: list[list[list[float]]]
    large_factor: float
    large_fraction: float
    seed: int = 0
    per_prompt: dict[str, Any] = field(default_factory=dict)
    path_modules: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.per_prompt:
            self.per_prompt = prompt_statistics(
                np.asarray(self.cross), self.layer, self.large_factor, self.large_fraction
            )

    @property
    def n_prompts(self) -> int:
        return len(self.cross)

    def matrix(self) -> np.ndarray:
        """``[X, Y]`` the median over prompts of ``C_b``."""
        return np.median(np.asarray(self.cross), axis=0)

    def majority_large(self) -> np.ndarray:
        """``[X, Y]`` whether the cell is large (``C_b ≥ max(k, r · C_b[m, m])``) on more than
        half of the prompts: how the claims decide a cell."""
        large = np.asarray(self.per_prompt["large_count"])  # [X Y] prompts with a large cell
        return 2 * large > self.n_prompts

    def breadth_outcomes(self) -> claims.Outcomes:
        """Per earlier input layer ``Y < m``: is the cell ``(m, Y)`` large (majority)."""
        if self.layer == 0:
            raise claims.NotApplicable(_LAYER_ZERO)
        m = self.layer
        big = self.majority_large()
        return claims.Outcomes(
            [bool(big[m, y]) for y in range(m)],
            [depth_label(y, m) for y in range(m)],
            unit="earlier input layers",
        )

    def share_outcomes(self) -> claims.Outcomes:
        """Per large cell (majority) among inputs ``Y ≤ m``, cell ``(m, m)`` left out: is it in row
        ``m``."""
        if self.layer == 0:
            raise claims.NotApplicable(_LAYER_ZERO)
        m = self.layer
        big = self.majority_large() & judged_region(self.n_layers, m)
        cells = [(int(x), int(y)) for x, y in zip(*np.nonzero(big))]
        if not cells:
            raise claims.NotApplicable(
                "no cell of the judged region (inputs Y ≤ m, the cell (m, m) left out) is large on "
                "a majority of the prompts: no layer's weights make a massive output from a "
                "pre-emergence input, so there is no share to take (row_breadth counts none then)"
            )
        return claims.Outcomes(
            [x == m for x, _ in cells],
            [f"cell ({x}, {y}) = ({_rel(x, m)}, {_rel(y, m)})" for x, y in cells],
            unit="large cells",
        )

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

    def to_dict(self) -> dict[str, Any]:
        med = self.matrix()
        return {
            "layer": self.layer,
            "layer_1based": self.layer + 1,
            "layer_given": self.layer_given,
            "me_layer": self.me_layer,
            "me_layer_1based": None if self.me_layer is None else self.me_layer + 1,
            "matrix_median": med.tolist(),
            "row_me_median": med[self.layer].tolist(),
            "large_cells_of_median": self.large_cells(),
            "large_cells_majority": self.majority_cells(),
            "per_prompt": {
                **self.per_prompt,
                "position": self.positions,
                "length": self.prompt_lengths,
            },
            "normalisation": "C_b[X, Y] = ||F_X(resid_mid_Y[b, p_b])|| / median_{t != p_b} "
            "||ffn_out_X[b, t]||, F_X = layer X's FFN path (modules path_modules, in order; "
            "F_X(resid_mid_X) = ffn_out_X, hook_mlp_out); rows X = weights layer, columns Y = "
            "input layer",
            "path_modules": self.path_modules,
            "denominator_site": FFN_SITE,
            "large_rule": "C_b[X, Y] >= max(large_factor, large_fraction * C_b[m, m])",
            "large_factor": self.large_factor,
            "large_key": LARGE_KEY,
            "large_fraction": self.large_fraction,
            "large_fraction_key": "cross_keep",
            "model": self.model,
            "bos": self.bos,
            "index_convention": INDEX_CONVENTION,
            "n_layers": self.n_layers,
            "n_prompts": self.n_prompts,
            "prompt_lengths": self.prompt_lengths,
            "seed": self.seed,
            "cross": self.cross,
        }


def _rel(layer: int, m: int) -> str:
    return "m" if layer == m else f"m{layer - m:+d}"


_LAYER_ZERO = (
    "the tested layer is layer 0: there is no input from before the massive activation emerges to "
    "cross with"
)


def judged_region(n_layers: int, layer: int) -> np.ndarray:
    """``[X, Y]`` the cells the claims judge: inputs ``Y ≤ layer``, the cell ``(layer, layer)``
    left out."""
    region = np.zeros((n_layers, n_layers), dtype=bool)
    region[:, : layer + 1] = True
    region[layer, layer] = False
    return region


def prompt_statistics(
    cross: Float[np.ndarray, "prompt X Y"], layer: int, k: float, r: float
) -> dict[str, Any]:
    """Per prompt: ``share`` (row ``layer``'s share of the large cells among inputs ``Y ≤ layer``,
    cell ``(layer, layer)`` left out; 0 when none is large), ``breadth`` (fraction of ``Y < layer``
    with a large cell ``(layer, Y)``; NaN for layer 0), ``diagonal`` (``C[layer, layer]``) and
    ``threshold`` (``max(k, r · C[layer, layer])``, the large-cell bound); and ``large_count``
    (``[X][Y]``, on how many prompts each cell is large: the claims' majority)."""
    n, L, _ = cross.shape
    diag = cross[:, layer, layer]  # [prompt]
    thr = np.maximum(k, r * diag)  # [prompt]
    large = cross >= thr[:, None, None]  # [prompt X Y]
    region = judged_region(L, layer)
    in_region = (large & region).sum((1, 2))
    in_row = (large & region)[:, layer].sum(-1)
    share = np.where(in_region > 0, in_row / np.maximum(in_region, 1), 0.0)
    breadth = large[:, layer, :layer].mean(-1) if layer > 0 else np.full(n, np.nan)
    return {
        "share": share.tolist(),
        "breadth": breadth.tolist(),
        "diagonal": diag.tolist(),
        "threshold": thr.tolist(),
        "n_large_in_region": in_region.tolist(),
        "large_count": large.sum(0).tolist(),
    }


def ffn_path(
    model: LoadedModel, layer: int, h: Float[torch.Tensor, "... d_model"]
) -> Float[torch.Tensor, "... d_model"]:
    """``F_layer(h)``: layer ``layer``'s own FFN-path modules (``edits`` part ``ffn_path``: pre-FFN
    norm, FFN, and the post-FFN norm of a sandwich-norm model) applied to ``h`` in forward order, so
    the gain convention is the model's; on the layer's ``resid_mid`` it gives its ``hook_mlp_out``."""
    for single in part_members(model, "ffn_path"):
        h = part_module(model, layer, single)(h)
    return h


def cross_matrices(
    model: LoadedModel,
    resid_mid: Float[torch.Tensor, "layer batch pos d_model"],
    ffn_out_norms: Float[torch.Tensor, "layer batch pos"],
    mask: Bool[torch.Tensor, "batch pos"],
    positions: Int[torch.Tensor, " batch"],
) -> Float[torch.Tensor, "batch X Y"]:
    """``C_b[X, Y]`` (module docstring) from one run's ``resid_mid`` of every layer and the norms of
    the FFN's actual residual contributions (site ``ffn_out``, after any post-FFN norm; NaN at
    padding), with every layer's own FFN path (:func:`ffn_path`)."""
    L, B = model.n_layers, len(positions)
    idx = torch.arange(B)
    inputs = resid_mid[:, idx.to(resid_mid.device), positions.to(resid_mid.device)]  # [Y batch d]
    flat = inputs.reshape(L * B, -1)  # [Y*batch d_model]
    num = torch.empty(L, L, B)  # [X Y batch]
    with torch.no_grad():
        for x in range(L):
            num[x] = ffn_path(model, x, flat).float().norm(dim=-1).reshape(L, B).cpu()
    others = mask.clone()
    others[idx, positions] = False
    if not others.any(-1).all():
        raise ValueError("the cross needs prompts with at least 2 tokens (the others normalise)")
    den = ffn_out_norms.masked_fill(~others, float("nan")).nanmedian(dim=-1).values  # [X batch]
    return (num / den[:, None, :]).permute(2, 0, 1)  # [batch X Y]


def run(cfg: Config, model: LoadedModel | None = None) -> Result:
    """One forward pass, then the cross of every layer's FFN path with every layer's input.

    Raises:
        NotApplicable: no massive activation on the model and no ``cfg.layer``.
        ValueError: ``cfg.layer`` out of range.
    """
    model = model_for(cfg, model)
    if cfg.layer is not None:
        model.check_layer(cfg.layer)  # before the forward
    batch = short_batch(model, cfg.load_prompts(), cfg.n_prompts, cfg.max_tokens)
    crit = Criterion(kind=cfg.criterion)
    norms = NormRecorder(model, batch, (*SCAN_SITES, FFN_SITE))
    resid = ResidMidRecorder(model, batch)
    record(model, batch, [norms, resid])
    scan = norms.result()
    site = locate(model, batch, scan=scan, criterion=crit, layer=cfg.layer, seed=cfg.seed)
    layer = site.require("pass --layer to test a layer anyway")
    loc = site.location
    positions = torch.tensor(site.reference)
    cross = cross_matrices(model, resid.out, scan.site_norms(FFN_SITE), scan.mask, positions)
    return Result(
        model=model.name,
        bos=model.bos,
        layer=layer,
        layer_given=cfg.layer is not None,
        me_layer=loc.me_layer,
        n_layers=model.n_layers,
        positions=positions.tolist(),
        prompt_lengths=batch.lengths,
        cross=cross.tolist(),
        large_factor=claims.threshold(LARGE_KEY),
        large_fraction=claims.threshold("cross_keep"),
        seed=cfg.seed,
        path_modules=moved_modules(model, "ffn_path"),
    )


# ------------------------------------------------------------------------------------------
# claims
# ------------------------------------------------------------------------------------------


def _details(result: Result) -> str:
    m = result.layer
    med = result.matrix()
    return (
        f"m = {m} (1-based {m + 1}, {'--layer' if result.layer_given else 'detected'}; detected ME "
        f"layer {result.me_layer}); median-over-prompts row m for Y ≤ m: "
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
        stat=lambda r: claims.Sample(r.per_prompt["diagonal"]),
        unit="prompts",
        details=_details,
    ),
)
SPEC = claims.index(SPECS)


# ------------------------------------------------------------------------------------------
# figures and summary
# ------------------------------------------------------------------------------------------


def _path_text(result: Result) -> str:
    return " → ".join(result.path_modules) if result.path_modules else "FFN path"


def figures(result: Result) -> dict[str, go.Figure]:
    L, m = result.n_layers, result.layer
    med = result.matrix()
    layers = list(range(L))
    fig = go.Figure(
        go.Heatmap(
            z=np.log10(np.clip(med, 1e-12, None)).tolist(),
            x=layers,
            y=layers,
            customdata=med.tolist(),
            colorscale="Magma",
            colorbar_title="log10 C",
            hovertemplate="weights of layer %{y}, input of layer %{x}<br>C = %{customdata:.4g}"
            "<extra></extra>",
        )
    )
    fig.add_shape(
        type="rect",
        x0=-0.5,
        x1=L - 0.5,
        y0=m - 0.5,
        y1=m + 0.5,
        line={"color": "deepskyblue", "width": 2},
    )
    fig.add_vline(
        x=m + 0.5,
        line_dash="dash",
        line_color="deepskyblue",
        annotation_text=f"ME layer {m} (1-based {m + 1}): inputs ≤ {m} are judged",
        annotation_position="top left",
    )
    fig.update_layout(
        title=f"Weights × input cross: ‖F_X(resid_mid_Y)‖ of the massive token over the other tokens' "
        f"median FFN contribution (ffn_out) at X — {result.model}<br><sup>F_X = layer X's "
        f"{_path_text(result)}; median over "
        f"{result.n_prompts} prompts; row X = {m} boxed; large = C ≥ max({result.large_factor:g}, "
        f"{result.large_fraction:g} × C[{m}, {m}])</sup>",
        xaxis_title="input: resid_mid of layer Y (0-based)",
        yaxis_title="weights: FFN path of layer X (0-based)",
        template="plotly_white",
    )
    cross = np.asarray(result.cross)
    row = cross[:, m, :]  # [prompt Y]
    others = np.delete(cross, m, axis=1).max(axis=1)  # [prompt Y]: the largest other row
    fig_row = go.Figure()
    for name, vals in (
        (f"row X = {m} (ME layer)", row),
        ("largest other row", others),
    ):
        q1, q2, q3 = np.quantile(vals, [0.25, 0.5, 0.75], axis=0)
        fig_row.add_trace(
            go.Scatter(
                x=layers,
                y=q2.tolist(),
                mode="lines+markers",
                name=name,
                error_y={
                    "type": "data",
                    "symmetric": False,
                    "array": (q3 - q2).tolist(),
                    "arrayminus": (q2 - q1).tolist(),
                },
                hovertemplate="input layer %{x}: C = %{y:.4g}<extra>" + name + "</extra>",
            )
        )
    thr = float(np.median(result.per_prompt["threshold"]))
    # no annotation on the line: on a log axis plotly reads an annotation's y as log10(y)
    fig_row.add_hline(y=thr, line_dash="dot")
    fig_row.add_vline(
        x=m, line_dash="dash", line_color="firebrick", annotation_text=f"ME layer {m}"
    )
    fig_row.update_yaxes(type="log")
    fig_row.update_layout(
        title=f"The ME layer's FFN path fed the massive token's state of every layer — "
        f"{result.model}<br><sup>{_path_text(result)}; median and interquartile range over "
        f"{result.n_prompts} prompts; dotted: large (median threshold {thr:.3g})</sup>",
        xaxis_title="input: resid_mid of layer Y (0-based)",
        yaxis_title="C (massive-token FFN contribution / others' median)",
        template="plotly_white",
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
            f"{result.me_layer}   prompts {result.n_prompts}",
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
)
main = command(EXPERIMENT)


if __name__ == "__main__":
    raise SystemExit(main())
