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
from functools import partial

import numpy as np
import torch

from me_interp.models import Batch, LoadedModel
from me_interp.patching.metrics import LOGITS, PatchMetric, metric_hooks
from me_interp.patching.suffix import gather_last
from me_interp.patching.sweep import (
    HEAD_SITES,
    SweepResult,
    _Cells,
    _grid,
    _heads,
    evaluate_metrics,
    site_hook,
)
from me_interp.probes.batching import save_hook


def _grad_forward(model: LoadedModel, batch: Batch, metrics, site_names, hooks):
    """The corrupt forward with gradients: the site activations (grads retained) and each
    metric's per-row values; the embedding output is made a leaf so every activation is in the
    graph."""
    acts: dict[str, torch.Tensor] = {}
    store: dict[str, torch.Tensor] = {}

    def leaf(x, hook):
        return x.detach().requires_grad_(True)

    def keep(x, hook, *, key):
        if x.requires_grad:
            x.retain_grad()
        acts[key] = x
        return x

    wanted = metric_hooks(metrics)
    rec = [(n, partial(_record_grad, store=store, key=n)) for n in wanted if n != LOGITS]
    fwd = [("hook_embed", leaf), *hooks, *[(n, partial(keep, key=n)) for n in site_names], *rec]
    with torch.enable_grad():
        logits = model.bridge.run_with_hooks(
            batch.tokens, attention_mask=batch.attention_mask, fwd_hooks=fwd
        )
        mask = batch.attention_mask.bool()
        if LOGITS in wanted:
            store[LOGITS] = gather_last(logits, mask)
        values = {k: m(store, mask) for k, m in metrics.items()}
    return acts, values


def _record_grad(x: torch.Tensor, hook, *, store: dict, key: str):
    store[key] = x
    return x


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
    intervals and figures work unchanged; ``method`` is ``"attribution"``. The clean forward, one
    corrupt forward with gradients and one backward per metric, whatever the number of cells.
    """
    if heads is not None and site not in HEAD_SITES:
        _heads(site, clean.tokens, heads)  # the error, before any forward
    layers, pos_list = _grid(model, clean, corrupt, site, metrics, layers, positions, per_position)
    B = clean.tokens.shape[0]
    hook_of = {layer: site_hook(site, layer) for layer in layers}
    store: dict[str, torch.Tensor] = {}
    rec = [(n, partial(save_hook, store=store, key=n)) for n in dict.fromkeys(hook_of.values())]
    clean_vals = evaluate_metrics(model, clean, metrics, rec)
    clean_acts = {layer: store[hook_of[layer]].detach().clone() for layer in layers}
    grid = _Cells(site, layers, pos_list, _heads(site, clean_acts[layers[0]], heads))
    names_ = list(dict.fromkeys(hook_of.values()))
    arange_b = torch.arange(B, device=clean.tokens.device)
    values, corrupt_vals = {}, {}
    acts, vals = _grad_forward(model, corrupt, metrics, names_, corrupt_hooks)
    site_acts = [acts[n] for n in names_]
    for j, (k, v) in enumerate(vals.items()):
        for a in site_acts:
            a.grad = None
        # rows are independent prompts: row b's gradient is its own; one graph for every metric
        v.sum().backward(retain_graph=j < len(vals) - 1)
        corrupt_vals[k] = v.detach()
        out = v.detach().double().cpu().expand(*grid.shape, B).clone()
        prods: dict[int, torch.Tensor] = {}
        for c in grid.all():
            layer = layers[c[0]]
            a = acts[hook_of[layer]]
            if a.grad is None:  # the metric does not depend on this activation
                continue
            if layer not in prods:
                prods[layer] = ((clean_acts[layer] - a.detach()) * a.grad).double()  # [B, ...]
            part = prods[layer][grid.index([c], arange_b, B)]  # [B, ...]: what the cell patches
            out[grid.at(c)] += part.reshape(B, -1).sum(-1).cpu()
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
