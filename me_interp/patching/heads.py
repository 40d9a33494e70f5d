"""Patching *sets* of attention heads at once: every head of a set patched together, at every
position, from the clean run into the corrupt run.

A sweep (:func:`me_interp.patching.patch_sweep`) patches one cell at a time. A question about a group
of heads — do the heads that attend most to the massive token carry its effect on the output, more
than as many random heads of the same layers? — needs the heads of a set patched *together*, in one
run: :func:`patch_head_sets` does that for many sets, batched the same way (row ``j·B + b`` is prompt
``b`` of the corrupt input with set ``j`` patched).

For a set ``S`` of ``(layer, head)`` and a per-head site (``attn_head_out`` = ``hook_z``,
``attn_head_pattern``, ``q``, ``k``, ``v``; ``k``/``v`` index the key-value heads), the patched run is
the corrupt run in which, at each layer ``l``, the site's activation of every head ``h`` with
``(l, h) ∈ S`` is replaced at every position by its value in the clean run of the same prompt
(TransformerLens's ``patch_head_vector`` / ``patch_head_pattern``, applied to several heads).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from me_interp.models import Batch, LoadedModel
from me_interp.patching.metrics import PatchMetric
from me_interp.patching.sweep import HEAD_SITES, _check_pair, evaluate_metrics, site_hook
from me_interp.probes.batching import save_hook

HeadSet = Sequence[tuple[int, int]]
"""A set of heads: ``(layer, head)`` pairs (0-based)."""


@dataclass
class HeadSetResult:
    """Per-prompt metric values of the runs with each head set patched.

    Attributes:
        site: the per-head site patched.
        sets: the head sets, as given (sorted, duplicates removed).
        values: ``metric -> [set, batch]``.
        clean, corrupt: ``metric -> [batch]`` of the unpatched runs.
        n_forwards: patched forwards run.
    """

    site: str
    sets: list[list[tuple[int, int]]]
    values: dict[str, torch.Tensor]
    clean: dict[str, torch.Tensor]
    corrupt: dict[str, torch.Tensor]
    n_forwards: int


def _index(site: str, rows: torch.Tensor, heads: torch.Tensor) -> tuple:
    """Index of heads ``heads[i]`` of rows ``rows[i]`` at every position: ``[batch pos head d]``
    (``attn_head_pattern``: ``[batch head query key]``)."""
    return (rows, heads) if site == "attn_head_pattern" else (rows, slice(None), heads)


def _patch(x: torch.Tensor, hook, *, index: tuple, src: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x[index] = src.to(device=x.device, dtype=x.dtype)
    return x


def patch_head_sets(
    model: LoadedModel,
    clean: Batch,
    corrupt: Batch,
    site: str,
    head_sets: Sequence[HeadSet],
    metrics: Mapping[str, PatchMetric],
    batch_size: int = 64,
    corrupt_hooks: Sequence = (),
    clean_hooks: Sequence = (),
) -> HeadSetResult:
    """Patch every head of each set together, at every position, from the clean run into the
    corrupt run; every metric per prompt.

    Args:
        model: the loaded model.
        clean, corrupt: the prompts, same shape and attention mask.
        site: a per-head site (:data:`~me_interp.patching.HEAD_SITES`).
        head_sets: the sets, each a non-empty sequence of ``(layer, head)``.
        metrics: name → metric (as for :func:`~me_interp.patching.patch_sweep`).
        batch_size: at most this many rows (patched prompts) per forward (at least one set).
        corrupt_hooks: row-wise hooks that define the corruption (run before the patch hooks, in
            the corrupt and every patched forward, on ``n·B`` rows).
        clean_hooks: hooks of the clean run.

    Raises:
        ValueError: not a per-head site, an empty set, a layer or head out of range, mismatched
            batches, no metric.
    """
    if site not in HEAD_SITES:
        raise ValueError(f"{site!r} is not a per-head site; choose from {', '.join(HEAD_SITES)}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not metrics:
        raise ValueError("give at least one metric")
    _check_pair(clean, corrupt)
    sets = [sorted({(int(la), int(h)) for la, h in s}) for s in head_sets]
    if not sets or any(not s for s in sets):
        raise ValueError("give at least one head set, each with at least one head")
    layers = sorted({la for s in sets for la, _ in s})
    for la in layers:
        model.check_layer(la)
    hook_of = {la: site_hook(site, la) for la in layers}
    store: dict[str, torch.Tensor] = {}
    rec = [(hook_of[la], partial(save_hook, store=store, key=hook_of[la])) for la in layers]
    clean_vals = evaluate_metrics(model, clean, metrics, [*clean_hooks, *rec])
    acts = {la: store[hook_of[la]].clone() for la in layers}
    axis = 1 if site == "attn_head_pattern" else 2
    n_heads = int(acts[layers[0]].shape[axis])
    bad = [(la, h) for s in sets for la, h in s if not 0 <= h < n_heads]
    if bad:
        raise ValueError(f"head {bad[0][1]} out of range: {site} has {n_heads} heads")
    corrupt_vals = evaluate_metrics(model, corrupt, metrics, corrupt_hooks)

    B = clean.tokens.shape[0]
    dev = clean.tokens.device
    per_fwd = max(1, batch_size // B)
    out = {k: torch.empty(len(sets), B, dtype=v.dtype) for k, v in corrupt_vals.items()}
    n_fwd = 0
    for start in range(0, len(sets), per_fwd):
        chunk = sets[start : start + per_fwd]
        n = len(chunk)
        rows_batch = Batch(corrupt.tokens.repeat(n, 1), corrupt.attention_mask.repeat(n, 1), None)
        hooks = []
        for la in layers:
            pairs = [(j, h) for j, s in enumerate(chunk) for lh, h in s if lh == la]
            if not pairs:
                continue
            rows = torch.tensor([j * B + b for j, _ in pairs for b in range(B)], device=dev)
            prompt = torch.arange(B, device=dev).repeat(len(pairs))
            heads = torch.tensor([h for _, h in pairs for _ in range(B)], device=dev)
            src = acts[la][_index(site, prompt, heads)]
            hooks.append((hook_of[la], partial(_patch, index=_index(site, rows, heads), src=src)))
        vals = evaluate_metrics(model, rows_batch, metrics, [*corrupt_hooks, *hooks])
        n_fwd += 1
        for k, v in vals.items():
            out[k][start : start + n] = v.view(n, B).cpu()
    return HeadSetResult(site, sets, out, clean_vals, corrupt_vals, n_fwd)
