"""The weights × input cross: every layer's FFN path fed every layer's input of the massive token.

For prompt ``b`` with massive token ``p_b``, weights layer ``X`` and input layer ``Y``::

    C_b[X, Y] = ‖F_X(resid_mid_{Y,b}[p_b])‖ / median_{t ≠ p_b} ‖ffn_out_{X,b}[t]‖

with ``F_X`` layer ``X``'s whole FFN path (:func:`ffn_path`: pre-FFN norm, FFN and, on a
sandwich-norm model, the post-FFN norm), so ``F_X(resid_mid_X) = ffn_out_X`` (``hook_mlp_out``) and
``C ≈ 1`` is an ordinary FFN contribution; the diagonal ``C_b[X, X]`` is the actual massive-token
ratio of layer ``X``'s FFN output. A cell is *large* when ``C_b[X, Y] ≥ max(k, r · C_b[m, m])``
(outsized, and keeping a fraction ``r`` of what the ME layer ``m`` really makes).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from jaxtyping import Bool, Float, Int

from me_interp import claims
from me_interp.loading.loaded import LoadedModel


def ffn_path(
    model: LoadedModel, layer: int, h: Float[torch.Tensor, "... d_model"]
) -> Float[torch.Tensor, "... d_model"]:
    """``F_layer(h)``: layer ``layer``'s own FFN-path modules (the pre-FFN norm, the FFN and the
    post-FFN norm where the model has one: ``edits`` part ``ffn_path``) applied to ``h`` in forward
    order, so the gain convention is the model's; on the layer's ``resid_mid`` it gives its
    ``hook_mlp_out``."""
    h = model.bridge.blocks[layer].mlp.original_component(model.ffn_norm_module(layer)(h))
    post = model.post_ffn_norm_module(layer)
    return h if post is None else post(h)


def cross_matrices(
    model: LoadedModel,
    resid_mid: Float[torch.Tensor, "layer batch pos d_model"],
    ffn_out_norms: Float[torch.Tensor, "layer batch pos"],
    mask: Bool[torch.Tensor, "batch pos"],
    positions: Int[torch.Tensor, " batch"],
) -> Float[torch.Tensor, "batch X Y"]:
    """``C_b[X, Y]`` (module docstring) from one run's ``resid_mid`` of every layer and the norms of
    the FFN's actual residual contributions (site ``ffn_out``; NaN at padding)."""
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


def judged_region(n_layers: int, layer: int) -> np.ndarray:
    """``[X, Y]`` the cells a claim about row ``layer`` judges: inputs ``Y ≤ layer``, the observed
    cell ``(layer, layer)`` left out (later inputs already carry the massive activation)."""
    region = np.zeros((n_layers, n_layers), dtype=bool)
    region[:, : layer + 1] = True
    region[layer, layer] = False
    return region


@dataclass(frozen=True)
class PromptStats:
    """Per prompt: ``share`` (row ``m``'s share of the large cells of the judged region; 0 when none
    is large), ``breadth`` (fraction of inputs ``Y < m`` with a large cell ``(m, Y)``; NaN for
    ``m = 0``), ``diagonal`` (``C[m, m]``), ``threshold`` (``max(k, r · C[m, m])``) and
    ``n_large_in_region``; ``large_count[X][Y]``: on how many prompts each cell is large."""

    share: list[float]
    breadth: list[float]
    diagonal: list[float]
    threshold: list[float]
    n_large_in_region: list[int]
    large_count: list[list[int]]


def prompt_statistics(
    cross: Float[np.ndarray, "prompt X Y"], layer: int, k: float, r: float
) -> PromptStats:
    """:class:`PromptStats` of the cross matrices ``cross`` for row ``layer``."""
    n, L, _ = cross.shape
    diag = cross[:, layer, layer]  # [prompt]
    thr = np.maximum(k, r * diag)  # [prompt]
    large = cross >= thr[:, None, None]  # [prompt X Y]
    region = judged_region(L, layer)
    in_region = (large & region).sum((1, 2))
    in_row = (large & region)[:, layer].sum(-1)
    share = np.where(in_region > 0, in_row / np.maximum(in_region, 1), 0.0)
    breadth = large[:, layer, :layer].mean(-1) if layer > 0 else np.full(n, np.nan)
    return PromptStats(
        share.tolist(),
        breadth.tolist(),
        diag.tolist(),
        thr.tolist(),
        in_region.tolist(),
        large.sum(0).tolist(),
    )


_LAYER_ZERO = (
    "the tested layer is layer 0: there is no input from before the massive activation emerges to "
    "cross with"
)


def _rel(layer: int, m: int) -> str:
    return "m" if layer == m else f"m{layer - m:+d}"


def breadth_outcomes(large: np.ndarray, m: int) -> claims.Outcomes:
    """Per earlier input layer ``Y < m``: is the cell ``(m, Y)`` of ``large`` (``[X, Y]``) large."""
    if m == 0:
        raise claims.NotApplicable(_LAYER_ZERO)
    return claims.Outcomes(
        [bool(large[m, y]) for y in range(m)],
        [f"layer {y} ({_rel(y, m)})" for y in range(m)],
        unit="earlier input layers",
    )


def share_outcomes(large: np.ndarray, m: int) -> claims.Outcomes:
    """Per large cell of the judged region (:func:`judged_region`): is it in row ``m``."""
    if m == 0:
        raise claims.NotApplicable(_LAYER_ZERO)
    big = large & judged_region(large.shape[0], m)
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
