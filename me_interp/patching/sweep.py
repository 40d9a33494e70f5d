"""Batched activation patching: many patches in one forward, one patch per batch row.

Activation patching (ROME; ARENA) runs a *corrupt* input, overwrites one activation with its value from
the *clean* run, and measures how much of the clean behaviour comes back, by a metric
(:mod:`me_interp.patching.metrics`: the massive activation's norm, projection and sink, or logits —
logit difference, answer probability, KL to the clean distribution, any callable).

The normalised score of a patch is ARENA's ``(m_patched − m_corrupt) / (m_clean − m_corrupt)`` on the
prompt-mean metric: 1 = the patch restores the clean value, 0 = it does nothing.

**Cells.** A sweep patches one site over a grid of cells, with TransformerLens's patch setters:

* residual-shaped sites (``resid_pre``, ``attn_out``, ``mlp_out``/``ffn_out``, ``ffn_in``, ...,
  ``[batch, pos, d_model]``): cell ``(layer, pos)``, or ``(layer,)`` for the whole sequence
  (``per_position=False``);
* per-head sites: ``attn_head_out`` (``hook_z``, each head's output before ``W_O``), ``q``, ``k``,
  ``v`` (``[batch, pos, head, d_head]``; ``k``/``v`` have the key-value heads) and
  ``attn_head_pattern`` (``[batch, head, query, key]``): cell ``(layer, pos, head)`` — for the
  pattern ``pos`` is the destination (query) position — or ``(layer, head)`` over all positions.

**Batching.** Every cell becomes ``B`` rows of one big batch (``B`` = number of prompts): row
``c·B + b`` is prompt ``b`` of the corrupt input with cell ``c`` patched. One hook per layer copies the
clean activation of prompt ``b`` at cell ``c`` into exactly the rows of that layer's cells, so a
chunk of ``batch_size`` rows is one forward instead of ``batch_size / B`` forwards. The results equal
``transformer_lens.patching`` on the same inputs (tests/test_patching.py, tests/test_patching_pairs.py).

Corruption hooks (``corrupt_hooks``) run in the corrupt and in every patched forward, before the patch
hooks, so patching the corrupted site itself from the clean run undoes the corruption. They see
batches of ``n·B`` rows (``n`` copies of the ``B`` corrupt prompts), so they must be row-wise or tile
per-prompt values that way: the hooks of :mod:`me_interp.interventions.causal` do both
(``per_prompt=False`` / ``True``).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from jaxtyping import Float

from me_interp import names, terminal
from me_interp.models import Batch, LoadedModel
from me_interp.patching.metrics import LOGITS, PatchMetric, hook_layer, metric_hooks, normalized
from me_interp.patching.suffix import (
    ROW_POSITIONS_X_D,
    _assemble,
    _mismatch,
    _run_suffix,
    _schedule,
    check_blocks,
    clean_from_prefix,
    corrupt_prefix,
    forward_metrics,
    gather_last,
    last_token_logits,
)
from me_interp.probes.batching import give_up, save_hook

HEAD_SITES: dict[str, str] = {
    "attn_head_out": "z",
    "attn_head_pattern": "pattern",
    "q": "q",
    "k": "k",
    "v": "v",
}
"""Per-head sites and the :mod:`me_interp.names` site each one patches."""

#: Sites a sweep can patch; ``mlp_out`` is TransformerLens' name for ``ffn_out``.
PATCH_SITES: tuple[str, ...] = (*names.SITES, "mlp_out", *HEAD_SITES)


def site_hook(site: str, layer: int) -> str:
    """Hook name of a patchable ``site`` of block ``layer`` (``mlp_out`` = ``ffn_out``)."""
    if site not in PATCH_SITES:
        raise ValueError(f"unknown patching site {site!r}; choose from {', '.join(PATCH_SITES)}")
    if site in HEAD_SITES:
        return names.site(HEAD_SITES[site], layer)
    return names.site("ffn_out" if site == "mlp_out" else site, layer)


def _index(site: str, rows, pos, head) -> tuple:
    """Index of the patched part of ``site``'s activation for rows ``rows`` (TransformerLens's
    patch setters): ``pos`` / ``head`` per row, ``None`` for every position / not a head site."""
    if head is None:
        return (rows,) if pos is None else (rows, pos)
    if site == "attn_head_pattern":  # [batch head query key]
        return (rows, head) if pos is None else (rows, head, pos)
    return (rows, slice(None), head) if pos is None else (rows, pos, head)  # [batch pos head d]


def evaluate_metrics(
    model: LoadedModel,
    batch: Batch,
    metrics: Mapping[str, PatchMetric],
    fwd_hooks: Sequence = (),
    stop_at_layer: int | None = None,
) -> dict[str, Float[torch.Tensor, " batch"]]:
    """One forward of ``batch`` with ``fwd_hooks``; every metric per prompt.

    ``stop_at_layer``: run only blocks ``0 .. stop_at_layer − 1`` (no unembedding); it must cover
    every block a metric (and any recording hook in ``fwd_hooks``) reads. It is ignored when a metric
    reads :data:`~me_interp.patching.metrics.LOGITS`.
    """
    store: dict[str, torch.Tensor] = {}
    wanted = metric_hooks(metrics)
    rec = [(n, partial(save_hook, store=store, key=n)) for n in wanted if n != LOGITS]
    kwargs = (
        {} if stop_at_layer is None or LOGITS in wanted else {"stop_at_layer": int(stop_at_layer)}
    )
    logits = model.run_with_hooks(batch, [*fwd_hooks, *rec], **kwargs)
    mask = batch.attention_mask.bool()
    if LOGITS in wanted:
        store[LOGITS] = gather_last(logits, mask)
    return {k: m(store, mask) for k, m in metrics.items()}


# ------------------------------------------------------------------------------------------
# the sweep
# ------------------------------------------------------------------------------------------


@dataclass
class SweepResult:
    """Per-prompt metric values of a patching sweep over one site.

    ``values[metric]`` is ``[layer, (pos), (head), batch]`` in the order of ``layers``,
    ``positions`` (absent when ``positions`` is ``None``: every cell patches all positions) and
    ``heads`` (absent when ``None``: not a per-head site) — ``axes`` names them. ``clean`` /
    ``corrupt`` are the unpatched runs' ``[batch]`` values. ``to_dict()`` keeps them all
    (``per_prompt``), so intervals can be bootstrapped over prompts from a saved result.
    ``n_cells_run`` cells were run; ``n_cells_clean`` took the clean run's values (cells that repeat
    it: :func:`patch_sweep`'s ``skip_shared``). ``prefix_fallback`` says why a ``skip_shared`` sweep
    fell back to full forwards (``None`` when it did not, or did not try); ``positions_skipped``
    whether chunks ran only the positions their patches can change, and ``positions_fallback`` why
    not where that was tried and failed. ``method`` is ``"exact"`` (patched forwards) or
    ``"attribution"`` (the first-order estimate, :mod:`me_interp.patching.attribution`).
    """

    site: str
    layers: list[int]
    positions: list[int] | None
    values: dict[str, torch.Tensor]
    clean: dict[str, torch.Tensor]
    corrupt: dict[str, torch.Tensor]
    n_forwards: int = 0
    batch_size: int = 0
    metric_names: list[str] = field(default_factory=list)
    prefix_skipped: bool = False
    prefix_fallback: str | None = None
    heads: list[int] | None = None
    n_cells_run: int = 0
    n_cells_clean: int = 0
    method: str = "exact"
    positions_skipped: bool = False
    positions_fallback: str | None = None

    @property
    def axes(self) -> tuple[str, ...]:
        return (
            "layer",
            *(("pos",) if self.positions is not None else ()),
            *(("head",) if self.heads is not None else ()),
        )

    def mean(self, metric: str) -> torch.Tensor:
        """Prompt-mean metric per cell, ``[layer, (pos), (head)]``."""
        return self.values[metric].mean(-1)

    def normalized(self, metric: str) -> torch.Tensor:
        """``(mean patched − mean corrupt) / (mean clean − mean corrupt)`` per cell."""
        return normalized(self.mean(metric), self.clean[metric].mean(), self.corrupt[metric].mean())

    def _at(self, layer: int, pos: int | None, head: int | None) -> tuple[int, ...]:
        at = [self.layers.index(layer)]
        if self.positions is not None:
            if pos is None:
                raise ValueError("this sweep patched each position: give pos")
            at.append(self.positions.index(pos))
        if self.heads is not None:
            if head is None:
                raise ValueError("this sweep patched each head: give head")
            at.append(self.heads.index(head))
        return tuple(at)

    def cell(
        self,
        metric: str,
        layer: int,
        pos: int | None = None,
        normalise: bool = True,
        head: int | None = None,
    ) -> float:
        grid = self.normalized(metric) if normalise else self.mean(metric)
        return float(grid[self._at(layer, pos, head)])

    def cell_values(
        self, metric: str, layer: int, pos: int | None = None, head: int | None = None
    ) -> Float[torch.Tensor, " batch"]:
        """Per-prompt metric values of the run with cell ``(layer, pos, head)`` patched."""
        return self.values[metric][self._at(layer, pos, head)]

    def to_dict(self) -> dict:
        return {
            "site": self.site,
            "axes": list(self.axes),
            "layers": self.layers,
            "positions": self.positions,
            "heads": self.heads,
            "clean_mean": {k: float(v.mean()) for k, v in self.clean.items()},
            "corrupt_mean": {k: float(v.mean()) for k, v in self.corrupt.items()},
            "normalized": {k: self.normalized(k).tolist() for k in self.values},
            "mean": {k: self.mean(k).tolist() for k in self.values},
            "n_forwards": self.n_forwards,
            "n_cells_run": self.n_cells_run,
            "n_cells_clean": self.n_cells_clean,
            "method": self.method,
            "positions_skipped": self.positions_skipped,
            "positions_fallback": self.positions_fallback,
            "batch_size": self.batch_size,
            "prefix_skipped": self.prefix_skipped,
            "prefix_fallback": self.prefix_fallback,
            "per_prompt": {
                "clean": {k: v.tolist() for k, v in self.clean.items()},
                "corrupt": {k: v.tolist() for k, v in self.corrupt.items()},
                "patched": {k: v.tolist() for k, v in self.values.items()},
            },
        }


def _patch(x: torch.Tensor, hook, *, index, src):
    x = x.clone()
    x[index] = src.to(device=x.device, dtype=x.dtype)
    return x


def _check_pair(clean: Batch, corrupt: Batch) -> None:
    if clean.tokens.shape != corrupt.tokens.shape:
        raise ValueError(
            f"clean and corrupt batches must have the same shape, got {tuple(clean.tokens.shape)} "
            f"and {tuple(corrupt.tokens.shape)}: corrupt prompts must have the clean token length"
        )
    if not torch.equal(clean.attention_mask, corrupt.attention_mask):
        raise ValueError("clean and corrupt batches must have the same attention mask (lengths)")


@dataclass(frozen=True)
class _Cells:
    """The grid of a sweep: cell ``(li, pi, hi)`` indexes ``layers``, ``positions`` (``None``:
    every position at once) and ``heads`` (``None``: not a per-head site)."""

    site: str
    layers: list[int]
    positions: list[int] | None
    heads: list[int] | None

    @property
    def shape(self) -> list[int]:
        return [len(x) for x in (self.layers, self.positions, self.heads) if x is not None]

    def all(self) -> list[tuple]:
        grid = [range(len(self.layers))]
        grid.append(range(len(self.positions)) if self.positions is not None else [None])
        grid.append(range(len(self.heads)) if self.heads is not None else [None])
        return list(itertools.product(*grid))

    @staticmethod
    def at(c: tuple) -> tuple[int, ...]:
        """Index of cell ``c`` in a ``[layer, (pos), (head), ...]`` grid."""
        return tuple(i for i in c if i is not None)

    def index(
        self, cells: Sequence[tuple], rows: torch.Tensor, n_rows: int, shift: int = 0
    ) -> tuple:
        """Index of the patched part of the site's activation: ``rows`` (``n_rows`` per cell) of
        each of ``cells`` in turn (positions counted from ``shift``, for a run of positions
        ``shift..`` only)."""
        dev = rows.device
        pos = head = None
        if self.positions is not None:
            pos = torch.tensor(
                [self.positions[c[1]] - shift for c in cells for _ in range(n_rows)], device=dev
            )
        if self.heads is not None:
            head = torch.tensor(
                [self.heads[c[2]] for c in cells for _ in range(n_rows)], device=dev
            )
        return _index(self.site, rows, pos, head)


def _grid(
    model: LoadedModel,
    clean: Batch,
    corrupt: Batch,
    site: str,
    metrics: Mapping[str, PatchMetric],
    layers: Sequence[int] | None,
    positions: Sequence[int] | None,
    per_position: bool,
) -> tuple[list[int], list[int] | None]:
    """The checked layers and positions of a sweep (``ValueError`` for bad ones)."""
    _check_pair(clean, corrupt)
    if not metrics:
        raise ValueError("give at least one metric")
    site_hook(site, 0)  # the site's name is checked before anything runs
    T = clean.tokens.shape[1]
    layers = list(range(model.n_layers)) if layers is None else [int(x) for x in layers]
    if not layers:
        raise ValueError("nothing to patch: layers must not be empty")
    for layer in layers:
        model.check_layer(layer)
    if not per_position:
        if positions is not None:
            raise ValueError("per_position=False patches every position: give no positions")
        return layers, None
    pos_list = list(range(T)) if positions is None else [int(p) for p in positions]
    if not pos_list:
        raise ValueError("nothing to patch: positions must not be empty")
    for p in pos_list:
        if not 0 <= p < T:
            raise ValueError(f"position {p} out of range for prompts of {T} tokens")
    return layers, pos_list


def _heads(site: str, act: torch.Tensor, heads: Sequence[int] | None) -> list[int] | None:
    """The checked heads of a per-head ``site`` (``None`` for any other site) from its activation
    (``k``/``v`` have the key-value heads)."""
    if site not in HEAD_SITES:
        if heads is not None:
            raise ValueError(
                f"heads are only for the per-head sites ({', '.join(HEAD_SITES)}), not {site!r}"
            )
        return None
    n_heads = int(act.shape[1] if site == "attn_head_pattern" else act.shape[2])
    head_list = list(range(n_heads)) if heads is None else [int(h) for h in heads]
    if not head_list:
        raise ValueError("nothing to patch: heads must not be empty")
    for h in head_list:
        if not 0 <= h < n_heads:
            raise ValueError(f"head {h} out of range: {site} has {n_heads} heads")
    return head_list


def patch_sweep(
    model: LoadedModel,
    clean: Batch,
    corrupt: Batch,
    site: str,
    metrics: Mapping[str, PatchMetric],
    layers: Sequence[int] | None = None,
    positions: Sequence[int] | None = None,
    batch_size: int | None = None,
    corrupt_hooks: Sequence = (),
    clean_hooks: Sequence = (),
    progress: bool | None = None,
    skip_shared: bool = True,
    heads: Sequence[int] | None = None,
    per_position: bool = True,
) -> SweepResult:
    """Patch ``site`` from the clean run into the corrupt run at every cell, batched.

    Args:
        model: the loaded model.
        clean: clean prompts.
        corrupt: corrupt prompts, same shape and attention mask as ``clean``.
        site: one of :data:`PATCH_SITES` (per-head sites: :data:`HEAD_SITES`).
        metrics: name → :class:`~me_interp.patching.metrics.PatchMetric` (e.g. ``NormRatio``,
            ``SinkMass``, ``LogitDiff``).
        layers: layers to patch (default all).
        positions: positions to patch (default all); for ``attn_head_pattern`` the destination
            (query) positions.
        batch_size: the work of at most this many full-length rows (patched prompts) per forward,
            counted in row-positions: a chunk of cells that runs positions ``p..`` of ``T`` holds
            up to ``batch_size · T / (T − p)`` rows (at least one cell). ``None``: as many as
            :data:`~me_interp.patching.suffix.ROW_POSITIONS_X_D` ``/ d_model`` row-positions,
            where a block call runs at a plain forward's FLOP rate.
        corrupt_hooks: row-wise hooks that define the corruption (run before the patch hooks).
        clean_hooks: hooks of the clean run.
        progress: ``False``: no progress bar; else a tqdm bar on stderr when it is a terminal (off
            in quiet mode, :func:`me_interp.terminal.bar`).
        skip_shared: run only what a patch can change. A cell whose clean activation equals the
            corrupt one for every prompt (bit for bit: e.g. every layer upstream of a hook-based
            corruption, or the unchanged tokens at layer 0) and a cell after the last layer a metric
            reads cannot change the corrupt run, so its value is the corrupt value and it is not run.
            Likewise a ``resid_pre`` cell whose patch makes the whole stream entering its block the
            clean run's (clean and corrupt differ only where it patches, or it patches every
            position), with no corruption hook from that block on, no clean hook and no metric
            reading an earlier block, repeats the clean run: its values are the clean values
            (``SweepResult.n_cells_clean``).
            In a chunk, each cell's rows join the run at the cell's own layer (a patch at layer
            ``L`` cannot change blocks before ``L``) with the corrupt run's residual stream there,
            and run to the last layer a metric reads (and the unembedding at the last token when a
            metric reads logits); the blocks are called directly with the masks and rotary
            embeddings captured from the corrupt run, checked once against the full corrupt
            forward, else full forwards are used with a ``RuntimeWarning`` —
            ``SweepResult.prefix_skipped`` says which and ``prefix_fallback`` why; with
            :data:`STRICT_ENV` set the fallback raises. Metric activations of blocks a row has not
            run are the corrupt run's. (TransformerBridge's own ``start_at_layer`` runs the earlier
            blocks anyway in TL 4.3, so it is not used.) A chunk of cells patched at one position
            each also runs only positions from its first patched position on (a patch cannot
            change earlier positions: attention is causal), the earlier keys and values coming
            from the corrupt run's cache — when the prompts are unpadded and no corruption hook
            acts inside the run; checked by control rows (the corrupt prompts unpatched, from the
            first block above every corruption hook) that ride in the first chunk run where one
            runs at most two positions, else run alone at the last two; where they disagree, every
            position (``SweepResult.positions_skipped`` / ``positions_fallback``). Cells are
            grouped by
            the position they run from, so a chunk never runs a cell's rows at positions it
            cannot change (the work is each cell's own: blocks ``L..`` at positions ``p..``).
            ``False``: every cell, full forwards (the plain reference).
        heads: heads to patch at a per-head site (default all of that site: ``k``/``v`` have the
            key-value heads).
        per_position: ``False``: one cell per layer (and head) patching every position at once
            (TransformerLens's ``*_all_pos``).

    Raises:
        ValueError: unknown site, layer/position/head out of range, mismatched batches, no metric.
        RuntimeError: the block suffix cannot be run while :data:`STRICT_ENV` is set.
    """
    args = (model, clean, corrupt, site, metrics, layers, positions, batch_size)
    kwargs = dict(
        corrupt_hooks=corrupt_hooks,
        clean_hooks=clean_hooks,
        progress=progress,
        skip_shared=skip_shared,
        heads=heads,
        per_position=per_position,
    )
    try:
        return _sweep(*args, **kwargs, by_position=True)
    except _PositionsFailed as e:  # the first chunk's control rows: run every position
        give_up(f"patch_sweep runs every position (slower, same values): {e.why}", e.err)
        res = _sweep(*args, **kwargs, by_position=False)
        res.positions_fallback = e.why
        return res


class _PositionsFailed(Exception):
    """The control rows of a sweep's first chunk did not reproduce the corrupt run: ``why``, and
    the error raised where running the chunk failed."""

    def __init__(self, why: str, err: BaseException | None = None):
        super().__init__(why)
        self.why, self.err = why, err


def _sweep(
    model: LoadedModel,
    clean: Batch,
    corrupt: Batch,
    site: str,
    metrics: Mapping[str, PatchMetric],
    layers: Sequence[int] | None,
    positions: Sequence[int] | None,
    batch_size: int | None,
    *,
    corrupt_hooks: Sequence,
    clean_hooks: Sequence,
    progress: bool | None,
    skip_shared: bool,
    heads: Sequence[int] | None,
    per_position: bool,
    by_position: bool,
) -> SweepResult:
    """:func:`patch_sweep`; ``by_position``: try running chunks at their later positions only
    (checked by control rows in the first chunk: :class:`_PositionsFailed` where they disagree)."""
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if heads is not None and site not in HEAD_SITES:
        _heads(site, clean.tokens, heads)  # the error, before any forward
    layers, pos_list = _grid(model, clean, corrupt, site, metrics, layers, positions, per_position)
    B = clean.tokens.shape[0]
    hook_of = {layer: site_hook(site, layer) for layer in layers}

    n_layers = model.n_layers
    mhooks = metric_hooks(metrics)
    last_needed = max(hook_layer(n, n_layers) for n in mhooks)
    wants_logits = LOGITS in mhooks
    stop = None if wants_logits else max(last_needed, *layers) + 1  # no unembedding unless read
    site_names = list(dict.fromkeys(hook_of.values()))
    hook_layers = [hook_layer(name, n_layers) for name, _ in corrupt_hooks]
    mask_b = corrupt.attention_mask.bool()
    cstore: dict[str, torch.Tensor] = {}
    cstore_m: dict[str, torch.Tensor] = {}
    rec = [(n, partial(save_hook, store=cstore, key=n)) for n in site_names]
    rec += [(n, partial(save_hook, store=cstore_m, key=n)) for n in mhooks if n != LOGITS]
    corrupt_logits = None
    # the clean run equals the corrupt one in the blocks before the first corruption hook's when
    # their tokens are the same and the clean run has no hook of its own: it then runs from the
    # last of them (whose input no corruption hook has touched; checked below)
    shared = max(0, min(hook_layers, default=0) - 1) if not clean_hooks else 0
    if shared and not torch.equal(clean.tokens, corrupt.tokens):
        shared = 0
    if skip_shared:
        # corrupt run: the metrics and their inputs, the site's activations (to find cells where
        # clean == corrupt) and what running blocks directly needs (each block's keyword
        # arguments and keys and values, the residual stream entering each patched layer, the
        # first block above every corruption hook and the first the clean run needs), in one
        # forward
        starts = {*layers, *(h + 1 for h in hook_layers if h + 1 < n_layers)}
        starts |= {shared} if shared else set()
        block_kw, resid_in, last_out, kv = corrupt_prefix(
            model, corrupt, [*corrupt_hooks, *rec], sorted(starts)
        )
        if wants_logits:
            corrupt_logits = last_token_logits(model, last_out, mask_b)
        corrupt_vals = {
            k: m({**cstore_m, LOGITS: corrupt_logits}, mask_b) for k, m in metrics.items()
        }
        # clean run: the site's activations and the clean metrics, through the last block read
        # (the unembedding of the last token only)
        if shared:
            known = {**cstore, **cstore_m}
            last_clean = max(hook_layer(n, n_layers) for n in [*mhooks, *site_names])
            got, clean_vals = clean_from_prefix(
                model, block_kw, resid_in, shared, last_clean, metrics, site_names, known, mask_b
            )
        else:
            got, clean_vals = forward_metrics(model, clean, metrics, site_names, clean_hooks)
        clean_acts = {layer: got[hook_of[layer]] for layer in layers}  # [B T ...]
    else:  # the plain reference: full forwards
        store: dict[str, torch.Tensor] = {}
        rec_c = [(n, partial(save_hook, store=store, key=n)) for n in site_names]
        clean_vals = evaluate_metrics(model, clean, metrics, [*clean_hooks, *rec_c], stop)
        clean_acts = {layer: store[hook_of[layer]].clone() for layer in layers}  # [B T ...]
        corrupt_vals = evaluate_metrics(model, corrupt, metrics, [*corrupt_hooks, *rec], stop)
    grid = _Cells(site, layers, pos_list, _heads(site, clean_acts[layers[0]], heads))

    out = {k: v.expand(*grid.shape, B).clone() for k, v in corrupt_vals.items()}
    arange_b = torch.arange(B, device=clean.tokens.device)

    def changes(c) -> bool:
        layer = layers[c[0]]
        if layer > last_needed:
            return False
        idx = grid.index([c], arange_b, B)
        return not torch.equal(clean_acts[layer][idx], cstore[hook_of[layer]][idx])

    first_read = min(hook_layer(n, n_layers) for n in mhooks)
    differ: dict[int, set[int]] = {}  # layer -> the positions where clean and corrupt differ

    def repeats_clean(c) -> bool:
        """Whether cell ``c``'s patch makes the whole stream entering its block the clean run's,
        with no corruption hook from that block on, no clean hook and no metric reading an earlier
        block: its run repeats the clean run from there, so its values are the clean values."""
        layer = layers[c[0]]
        if not skip_shared or site != "resid_pre" or clean_hooks or layer > first_read:
            return False
        if any(h >= layer for h in hook_layers):
            return False
        if grid.positions is None:  # every position patched
            return True
        if layer not in differ:
            d = clean_acts[layer] != cstore[hook_of[layer]]  # [B T d_model]
            differ[layer] = set(d.any(-1).any(0).nonzero()[:, 0].tolist())
        return differ[layer] <= {grid.positions[c[1]]}

    def split(ran: list) -> tuple[list, list]:
        """The cells to run, and those whose values are the clean run's."""
        same = [c for c in ran if repeats_clean(c)]
        taken = set(same)
        return [c for c in ran if c not in taken], same

    cells, same = split([c for c in grid.all() if not skip_shared or changes(c)])
    T = clean.tokens.shape[1]
    d_model = int(clean_acts[layers[0]].shape[-1]) if site not in HEAD_SITES else model.d_model
    budget = batch_size * T if batch_size is not None else max(B * T, ROW_POSITIONS_X_D // d_model)

    def first_change(c) -> int:
        """The first position cell ``c`` changes: its own one, or for a cell patching every
        position the first where its clean and corrupt activations differ in some prompt (the
        patch leaves the earlier ones bit-identical)."""
        if grid.positions is not None:
            return grid.positions[c[1]]
        layer = layers[c[0]]
        idx = grid.index([c], arange_b, B)
        differ = clean_acts[layer][idx] != cstore[hook_of[layer]][idx]  # [B pos ...]
        at = differ.reshape(B, differ.shape[1], -1).any(-1).any(0).nonzero()
        return int(at[0, 0]) if len(at) else 0

    def start_pos(c) -> int:
        """The first position cell ``c``'s run needs: the first it changes, when the prompts are
        not padded (each row's last real token is then in the run) and no corruption hook acts
        inside its run (it may index positions)."""
        if not pos_ok or corrupt.padded:
            return 0
        if any(h >= layers[c[0]] for h in hook_layers):
            return 0
        return first_change(c)

    n_fwd = 0
    suffix = None
    fallback: str | None = None
    pos_ok = False
    if skip_shared and (cells or shared):
        # run only blocks first_patched..last_needed, from the corrupt run's residual stream and
        # keys and values, checked once by a run of the last positions (of every position from
        # the first patched block where that lies below a corruption hook's block), else fall
        # back to full forwards. The clean run from block `shared` calls the blocks the same way.
        first0 = min([layers[c[0]] for c in cells], default=shared)
        first_p = max([first0, *(h + 1 for h in hook_layers)])  # above every corruption hook
        want = {**cstore_m, **({LOGITS: corrupt_logits} if wants_logits else {})}
        by_pos = kv is not None and T > 1 and not corrupt.padded and first_p <= last_needed
        by_pos = by_pos and by_position
        kv_p = {i: kv[i] for i in range(first_p, last_needed + 1)} if by_pos else None
        if not by_pos or first_p > first0:  # cells below a corruption hook run every position
            at = min(first0, shared) if shared else first0
            fallback = check_blocks(
                model, block_kw, resid_in, at, last_needed, corrupt_hooks, want, mask_b
            )
        # the position suffix (and, where no block check ran, the block suffix) is checked by
        # control rows in the first chunk run: unpatched corrupt prompts from block first_p on
        pos_ok = by_pos and fallback is None
        if fallback is None:
            suffix = (block_kw, resid_in, kv_p if pos_ok else None)
        elif shared:  # the clean run from the prefix is not to be trusted: a full forward
            got, clean_vals = forward_metrics(model, clean, metrics, site_names, clean_hooks)
            clean_acts = {layer: got[hook_of[layer]] for layer in layers}
            differ.clear()
            cells, same = split([c for c in grid.all() if changes(c)])
    for c in same:
        for k in out:
            out[k][grid.at(c)] = clean_vals[k]
    if suffix is not None:
        plan = _schedule(cells, start_pos, layers, budget, B, T)
    else:
        per_fwd = max(1, budget // (B * T))
        plan = [(0, cells[i : i + per_fwd]) for i in range(0, len(cells), per_fwd)]
    control = False  # whether the first chunk carries the control rows
    if pos_ok:
        # they ride in a chunk of at most two positions (two where one exists: the causal mask
        # among the new positions is then checked too), else run alone at the last two: no more
        # row-positions than that for the check (it also checks the block suffix where
        # check_blocks did not run)
        short = [i for i, (p0, _) in enumerate(plan) if 0 < p0 and T - p0 <= 2]
        if short:
            plan.insert(0, plan.pop(min(short, key=lambda i: plan[i][0])))
        else:
            plan.insert(0, (max(1, T - 2), []))
        control = True
    bar = terminal.bar(plan, desc=f"patching {site}") if progress is not False else plan
    max_rows = 0
    for i_chunk, (p0, chunk) in enumerate(bar):
        # in layer order: a cell's rows join the run at its own layer (_run_suffix), after the
        # control rows where the chunk has them (the first B)
        k0 = int(control and i_chunk == 0)
        n = len(chunk) + k0
        max_rows = max(max_rows, n * B)
        rows_batch = Batch(corrupt.tokens.repeat(n, 1), corrupt.attention_mask.repeat(n, 1), None)
        first = min(layers[c[0]] for c in chunk) if chunk and suffix is not None else 0
        first = first_p if k0 else first  # control rows join below every cell (first_p <= L)
        patch_hooks = []
        for li in sorted({c[0] for c in chunk}):
            idx = [j for j, c in enumerate(chunk) if c[0] == li]
            dev = clean.tokens.device
            rows = torch.tensor([(j + k0) * B + b for j in idx for b in range(B)], device=dev)
            prompt = torch.arange(B, device=dev).repeat(len(idx))
            mine = [chunk[j] for j in idx]
            src = clean_acts[layers[li]][grid.index(mine, prompt, B)]
            if grid.positions is None:  # every position of positions p0.. (the run's ones)
                src = src[:, p0:]
            fn = partial(_patch, index=grid.index(mine, rows, B, shift=p0), src=src)
            patch_hooks.append((hook_of[layers[li]], fn))
        acts: dict[str, torch.Tensor] = {}
        for n_ in mhooks:  # read before the first patched layer: the corrupt run's, exactly
            if n_ != LOGITS and hook_layer(n_, n_layers) < first:
                acts[n_] = cstore_m[n_].repeat(n, *([1] * (cstore_m[n_].dim() - 1)))
        rec = [
            (n_, partial(save_hook, store=acts, key=n_))
            for n_ in mhooks
            if n_ != LOGITS and hook_layer(n_, n_layers) >= first
        ]
        hooks = [*corrupt_hooks, *patch_hooks, *rec]
        mask = rows_batch.attention_mask.bool()
        if suffix is not None:
            entry = [first_p] * k0 + [layers[c[0]] for c in chunk]
            try:
                h, rows_at = _run_suffix(model, suffix, entry, last_needed, p0, B, hooks)
                _assemble(acts, {k: cstore_m[k] for k, _ in rec}, p0, n, rows_at, n_layers)
                if wants_logits:
                    acts[LOGITS] = last_token_logits(model, h, mask[:, p0:])
            except (TypeError, ValueError, RuntimeError, KeyError, AttributeError, IndexError) as e:
                if not k0:
                    raise
                why = f"running positions {p0}.. of blocks {first_p}..{last_needed} failed"
                raise _PositionsFailed(f"{why}: {type(e).__name__}: {e}", e) from e
            # the control rows: the corrupt run's values, else every position is run
            bad = _mismatch({k: v[:B] for k, v in acts.items()}, want) if k0 else None
            if bad is not None:
                raise _PositionsFailed(
                    f"running positions {p0}.. gave {bad[0]} up to {bad[1]:.3g} away from the "
                    "full run"
                )
        else:
            with torch.no_grad():
                logits = model.bridge.run_with_hooks(
                    rows_batch.tokens,
                    attention_mask=rows_batch.attention_mask,
                    stop_at_layer=last_needed + 1 if skip_shared and not wants_logits else None,
                    fwd_hooks=hooks,
                )
            if wants_logits:
                acts[LOGITS] = gather_last(logits, mask)
        n_fwd += 1
        for k, m in metrics.items():
            v = m(acts, mask).view(n, B)
            for j, c in enumerate(chunk):
                out[k][grid.at(c)] = v[j + k0]
    return SweepResult(
        site=site,
        layers=layers,
        positions=pos_list,
        values=out,
        clean=clean_vals,
        corrupt=corrupt_vals,
        n_forwards=n_fwd,
        batch_size=max_rows,
        metric_names=list(metrics),
        prefix_skipped=suffix is not None,
        prefix_fallback=fallback,
        heads=grid.heads,
        n_cells_run=len(cells),
        n_cells_clean=len(same),
        positions_skipped=pos_ok,
    )


def patch_loop(
    model: LoadedModel,
    clean: Batch,
    corrupt: Batch,
    site: str,
    metrics: Mapping[str, PatchMetric],
    layers: Sequence[int] | None = None,
    positions: Sequence[int] | None = None,
    corrupt_hooks: Sequence = (),
    **kwargs: Any,
) -> SweepResult:
    """The unbatched reference: one forward per cell (for tests and benchmarks)."""
    return patch_sweep(
        model,
        clean,
        corrupt,
        site,
        metrics,
        layers,
        positions,
        batch_size=1,
        corrupt_hooks=corrupt_hooks,
        progress=False,
        skip_shared=False,
        **kwargs,
    )
