"""Attribution patching: every cell of a sweep from one forward and one backward pass.

The first-order estimate of patching cell ``c`` (Nanda 2023; Syed et al. 2023) is

    m_patched(c) ≈ m_corrupt + Σ_{i∈c} (a_clean − a_corrupt)_i · ∂m/∂a_i |_corrupt,

with the gradient taken in the corrupt run (with its corruption hooks) and summed over the elements
the cell would overwrite (the same index as the exact patch, :func:`me_interp.patching.sweep._index`).
One forward and one backward give every cell of every layer of a site, so it is the fast first pass;
how well it ranks the cells like exact patching is measured, not assumed (:func:`rank_agreement`;
tests/test_patching_pairs.py, benchmarks/bench_patching.py). The estimate is linear: it misses
saturation (a softmax that is already one-hot, an RMSNorm that rescales), so large patches of the
massive activation itself are where it is least trustworthy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from me_interp.models import Batch, LoadedModel
from me_interp.patching.metrics import PatchMetric
from me_interp.patching.suffix import forward_metrics
from me_interp.patching.sweep import (
    HEAD_SITES,
    SweepResult,
    _Cells,
    _grid,
    _heads,
    site_hook,
)


def _cell_sums(site: str, prod: torch.Tensor, grid: _Cells) -> torch.Tensor:
    """``prod`` (one layer's ``(a_clean − a_corrupt) · ∂m/∂a``, ``[batch, ...]``) summed over
    what each cell of the layer patches: ``[(pos), (head), batch]`` in the grid's order."""
    per_pos = grid.positions is not None
    if site not in HEAD_SITES:  # [batch pos d]
        t = prod.sum(-1) if per_pos else prod.flatten(1).sum(-1)
    elif site == "attn_head_pattern":  # [batch head query key]
        t = prod.sum(-1).transpose(1, 2) if per_pos else prod.sum((2, 3))
    else:  # [batch pos head d]
        t = prod.sum(-1) if per_pos else prod.sum((1, 3))
    if per_pos:
        t = t[:, grid.positions]
    if grid.heads is not None:
        t = t[..., grid.heads]
    return t.movedim(0, -1)


def attribution_sweep(
    model: LoadedModel,
    clean: Batch,
    corrupt: Batch,
    site: str,
    metrics: Mapping[str, PatchMetric],
    layers: Sequence[int] | None = None,
    positions: Sequence[int] | None = None,
    corrupt_hooks: Sequence = (),
    heads: Sequence[int] | None = None,
    per_position: bool = True,
) -> SweepResult:
    """The attribution-patching estimate of :func:`me_interp.patching.patch_sweep` (same arguments,
    same result shape): ``values`` hold ``m_corrupt + attribution`` per prompt, so normalising,
    intervals and figures work unchanged; ``method`` is ``"attribution"``.

    The work, whatever the number of cells: the clean forward (without gradients), one corrupt
    forward with gradients and, per metric, one vector-Jacobian product on that graph to the site
    activations only (no weight gradients), and only to those whose clean and corrupt values
    differ (the others' cells are 0; with a corruption hook the backward stops at its block); both
    forwards stop at the last block a metric reads and unembed only each row's last token.
    """
    if heads is not None and site not in HEAD_SITES:
        _heads(site, clean.tokens, heads)  # the error, before any forward
    layers, pos_list = _grid(model, clean, corrupt, site, metrics, layers, positions, per_position)
    B = clean.tokens.shape[0]
    hook_of = {layer: site_hook(site, layer) for layer in layers}
    names_ = list(dict.fromkeys(hook_of.values()))
    clean_acts, clean_vals = forward_metrics(model, clean, metrics, names_, ())
    acts, vals = forward_metrics(model, corrupt, metrics, names_, corrupt_hooks, grad=True)
    grid = _Cells(site, layers, pos_list, _heads(site, clean_acts[names_[0]], heads))
    # the activations the metrics depend on (later ones are not in the graph) and whose clean and
    # corrupt values differ (where they are equal, every cell's attribution is 0 whatever the
    # gradient): the vector-Jacobian products stop there, e.g. at the first block a corruption
    # hook acts in, not at the embedding
    live = [
        n
        for n in names_
        if n in acts and acts[n].requires_grad and not torch.equal(clean_acts[n], acts[n].detach())
    ]
    values, corrupt_vals = {}, {}
    for j, (k, v) in enumerate(vals.items()):
        # rows are independent prompts: row b's gradient is its own; one graph for every metric
        grads = (
            torch.autograd.grad(
                v.sum(), [acts[n] for n in live], retain_graph=j < len(vals) - 1, allow_unused=True
            )
            if live
            else []
        )
        grad_of = dict(zip(live, grads))
        corrupt_vals[k] = v.detach()
        out = v.detach().double().cpu().expand(*grid.shape, B).clone()
        for li, layer in enumerate(layers):
            g = grad_of.get(hook_of[layer])
            if g is None:  # the metric does not depend on this activation
                continue
            prod = (clean_acts[hook_of[layer]] - acts[hook_of[layer]].detach()).double() * g
            out[li] += _cell_sums(site, prod, grid).cpu()
        values[k] = out
    return SweepResult(
        site=site,
        layers=layers,
        positions=pos_list,
        values=values,
        clean={k: v.detach() for k, v in clean_vals.items()},
        corrupt=corrupt_vals,
        n_forwards=2,  # the clean run; the corrupt run with one backward per metric
        batch_size=B,
        metric_names=list(metrics),
        heads=grid.heads,
        n_cells_run=0,
        method="attribution",
    )


def rank_agreement(a: SweepResult, b: SweepResult, metric: str) -> float:
    """Spearman rank correlation over the cells of two sweeps of the same grid (e.g. attribution
    against exact patching), on the normalised values; NaN cells are left out."""
    x = a.normalized(metric).double().flatten().numpy()
    y = b.normalized(metric).double().flatten().numpy()
    if x.shape != y.shape:
        raise ValueError(f"the sweeps have different grids ({a.axes} vs {b.axes})")
    keep = np.isfinite(x) & np.isfinite(y)
    if keep.sum() < 3:
        return float("nan")
    rx, ry = _ranks(x[keep]), _ranks(y[keep])
    if rx.std() == 0 or ry.std() == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


def _ranks(v: np.ndarray) -> np.ndarray:
    """1-based ranks; ties share their mean rank."""
    _, inv, counts = np.unique(v, return_inverse=True, return_counts=True)
    return (np.cumsum(counts) - (counts - 1) / 2.0)[inv]


__all__ = ["attribution_sweep", "rank_agreement"]
