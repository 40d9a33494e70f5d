"""Running only what a patch can change: the block and position suffixes of the corrupt run.

A patch at layer ``L`` cannot change blocks before ``L``, and (attention being causal) a patch at
position ``p`` cannot change positions before ``p``. :func:`me_interp.patching.patch_sweep` therefore
runs each cell's rows from its own block, starting from the corrupt run's residual stream there,
and a chunk of per-position cells from its first position, the earlier keys and values coming from
the corrupt run's own cache. One corrupt forward keeps all of it (:func:`corrupt_prefix`: each
block's keyword arguments, the residual stream entering each patched block, every block's keys and
values, passed to the bridge's attention as ``layer_past``); control rows (the corrupt prompts,
unpatched, from the first block above every corruption hook), riding in the sweep's first chunk
where it runs at most two positions, else run alone at the last two, check it against the full
corrupt forward, or :func:`check_blocks` where a position suffix cannot be used.
Where they do not reproduce the full forward, the sweep falls back to full forwards (or every
position) with a warning, or raises under :data:`STRICT_ENV`. Where the clean run equals the
corrupt run up to a block (same tokens, the corruption hooks later), :func:`clean_from_prefix` runs
it from there.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import torch
from jaxtyping import Float

from me_interp.models import Batch, LoadedModel
from me_interp.patching.metrics import LOGITS, hook_layer, metric_hooks
from me_interp.probes.batching import (
    block_inputs,
    final_logits,
    give_up,
    save_hook,
    stop_hook_name,
)
from me_interp.probes.batching import run_blocks as _run_blocks


def last_token_logits(
    model: LoadedModel, resid: Float[torch.Tensor, "batch pos d_model"], mask: torch.Tensor
) -> Float[torch.Tensor, "batch vocab"]:
    """The logits at each row's last real token from the last block's output ``resid``: the final
    norm and the unembedding (and a final logit soft-cap where the model has one) at that position
    only."""
    idx = mask.to(resid.device).long().sum(-1) - 1
    x = resid[torch.arange(resid.shape[0], device=resid.device), idx][:, None]  # [batch 1 d]
    return final_logits(model, x)[:, 0]


def gather_last(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's values at its last real token: ``logits[b, last_b]`` with ``last_b`` the number
    of real tokens of row ``b`` in ``mask`` minus one."""
    idx = mask.to(logits.device).long().sum(-1) - 1
    return logits[torch.arange(logits.shape[0], device=logits.device), idx]


def _tile(v, n: int, B: int):
    """Repeat the batch dimension of block kwargs ``n`` times (row ``c·B + b`` = prompt ``b``)."""
    if torch.is_tensor(v):
        return v.repeat(n, *([1] * (v.dim() - 1))) if v.dim() and v.shape[0] == B else v
    if isinstance(v, tuple):
        return tuple(_tile(x, n, B) for x in v)
    return v


def _mismatch(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]):
    """The first ``(name, largest gap)`` where ``got`` differs from ``want`` (another shape, or
    beyond rtol 1e-4 and atol 1e-5 plus 4e-6 of the tensor's largest magnitude; the gap is NaN for
    another shape), else ``None``. The scaled atol: elements near zero carry float32 summation noise
    of the tensor's scale (a massive activation, a vocabulary of logits) that changes with how the
    positions are batched; a wrong cache or mask moves them by far more."""
    for n in got:
        a, b = got[n].float(), want[n].float()
        if a.shape != b.shape:
            return n, float("nan")
        atol = 1e-5 + 4e-6 * float(b.abs().max())
        if not torch.allclose(a, b, rtol=1e-4, atol=atol):
            return n, float((a - b).abs().max())
    return None


_QUERY_AXIS_2 = ("hook_pattern", "hook_attn_scores")


def _pos_axis(name: str) -> int:
    """The position axis of a recorded activation: the query axis of patterns and scores
    ``[batch, head, query, key]``, else axis 1 (``[batch, pos, ...]``)."""
    return 2 if name.endswith(_QUERY_AXIS_2) else 1


def _slice_kwargs(kwargs: Mapping[int, Mapping], p: int, T: int, device) -> dict[int, dict]:
    """Block kwargs for running positions ``p..T-1`` only, the earlier keys and values coming from
    a cache: the mask's query rows, the rotary embeddings and position ids from ``p`` on."""

    def cut(k: str, v):
        if torch.is_tensor(v):
            if k == "attention_mask" and v.dim() == 4:
                return v[:, :, p:, :]
            if k == "position_ids" and v.dim() == 2:
                return v[:, p:]
            return v
        if k == "position_embeddings" and isinstance(v, tuple):
            return tuple(x[:, p:] for x in v)
        if k == "attention_mask" and isinstance(v, dict):
            return {kk: cut(k, vv) for kk, vv in v.items()}
        return v

    memo: dict[tuple, Any] = {}
    out = {}
    cache_position = torch.arange(p, T, device=device)
    for i, kw in kwargs.items():
        out[i] = {}
        for k, v in kw.items():
            key = (id(v), k)
            if key not in memo:
                memo[key] = (v, cut(k, v))  # keep v alive so its id stays unique
            out[i][k] = memo[key][1]
        out[i]["cache_position"] = cache_position
    return out


def logits_at_last(model: LoadedModel, resid: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """:func:`last_token_logits` in the autograd graph where gradients are on (the final norm and
    the unembedding of each row's last real token only, and a final soft-cap where the model has
    one)."""
    idx = mask.to(resid.device).long().sum(-1) - 1
    x = resid[torch.arange(resid.shape[0], device=resid.device), idx][:, None]  # [batch 1 d]
    logits = model.bridge.unembed(model.bridge.ln_final(x))[:, 0]
    cap = getattr(model.hf.config, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


class _Stopped(Exception):
    """Raised with the residual stream once every block a forward needs has run."""

    def __init__(self, resid: torch.Tensor):
        super().__init__()
        self.resid = resid


def _stop(x: torch.Tensor, hook) -> torch.Tensor:
    raise _Stopped(x)


def _record(x: torch.Tensor, hook, *, store: dict, key: str):
    store[key] = x
    return x


def forward_metrics(
    model: LoadedModel, batch: Batch, metrics, site_names, hooks, grad: bool = False
) -> tuple[dict, dict]:
    """One forward of ``batch`` under ``hooks`` through the last block a metric or a site is in
    (the logits at each row's last real token only, where a metric reads them): the activations
    ``site_names`` (detached copies, or with ``grad`` the graph's own tensors, the embedding
    output made a leaf so that they are in the graph also where the weights are frozen) and each
    metric's per-row values."""
    acts: dict[str, torch.Tensor] = {}
    store: dict[str, torch.Tensor] = {}

    def leaf(x, hook):
        return x.detach().requires_grad_(True)

    def keep(x, hook, *, key):
        acts[key] = x if grad else x.detach().clone()
        return x

    wanted = metric_hooks(metrics)
    last = max(hook_layer(n, model.n_layers) for n in [*wanted, *site_names])
    rec = [(n, partial(_record, store=store, key=n)) for n in wanted if n != LOGITS]
    fwd = [*hooks, *[(n, partial(keep, key=n)) for n in site_names], *rec]
    if grad:
        fwd.insert(0, ("hook_embed", leaf))
    stop = stop_hook_name(model, last)  # the input of the next block or of the final norm
    if stop is not None:
        fwd.append((stop, _stop))
    mask = batch.attention_mask.bool()
    with torch.set_grad_enabled(grad):
        try:
            out = model.bridge.run_with_hooks(
                batch.tokens, attention_mask=batch.attention_mask, fwd_hooks=fwd
            )
            logits = gather_last(out, mask)  # no stop hook: the full forward's logits
        except _Stopped as e:
            logits = logits_at_last(model, e.resid, mask) if LOGITS in wanted else None
        if LOGITS in wanted:
            store[LOGITS] = logits
        values = {k: m(store, mask) for k, m in metrics.items()}
    return acts, values


def corrupt_prefix(model: LoadedModel, batch: Batch, hooks, starts: Sequence[int]):
    """One forward of the corrupt ``batch`` under ``hooks`` (corruption and recording), stopped
    before the unembedding: each block's keyword arguments (masks, rotary embeddings), the
    residual stream entering each of ``starts``, the last block's output, and every block's keys
    and values (``{layer: (keys, values)}``, each ``[batch, kv_head, pos, d_head]``, as attention
    caches them: what the position suffix reads), or ``None`` where the model's attention takes no
    cache here (the forward is then run again without one)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    try:
        kwargs, store = block_inputs(model, batch, hooks, starts, cache=cache)
    except (TypeError, ValueError, RuntimeError, KeyError, AttributeError, IndexError):
        kwargs, store = block_inputs(model, batch, hooks, starts)
        cache = None
    kv = None
    if cache is not None and len(cache.layers) == model.n_layers:
        kv = {i: (c.keys, c.values) for i, c in enumerate(cache.layers)}
    last = store.pop(-1)
    return kwargs, store, last, kv


def check_blocks(model, kwargs, resid_in, first: int, last: int, hooks, want, mask) -> str | None:
    """Run blocks ``first..last`` directly from the corrupt run's residual stream entering
    ``first`` (under the corruption ``hooks``) and compare the metric inputs with the full corrupt
    forward's ``want``. Returns ``None`` when they agree, else why not, with a warning (under
    :func:`strict` a ``RuntimeError``): the sweep then runs full forwards."""
    names_ = [n for n in want if n != LOGITS and hook_layer(n, model.n_layers) >= first]
    got: dict[str, torch.Tensor] = {}
    rec = [(n, partial(save_hook, store=got, key=n)) for n in names_]
    why, err = None, None
    try:
        h = _run_blocks(model, resid_in[first], first, last, kwargs, [*hooks, *rec])
        if LOGITS in want:
            got[LOGITS] = last_token_logits(model, h, mask)
        bad = _mismatch(got, {n: want[n] for n in got})
        if bad is not None:
            why = (
                f"running blocks {first}..{last} directly gave {bad[0]} up to {bad[1]:.3g} away "
                "from the full forward"
            )
    except (TypeError, ValueError, RuntimeError, KeyError, AttributeError, IndexError) as e:
        why, err = f"running blocks {first}..{last} directly failed: {type(e).__name__}: {e}", e
    if why is not None:
        give_up(
            f"runs from the corrupt prefix fall back to full forwards (slower, same values): {why}",
            err,
        )
    return why


def clean_from_prefix(
    model: LoadedModel, kwargs, resid_in, start: int, last: int, metrics, site_names, known, mask
) -> tuple[dict, dict]:
    """The clean run where it equals the corrupt run before block ``start`` (the same tokens, no
    clean hook, every corruption hook in block ``start`` or later): blocks ``start..last`` run
    directly from the corrupt run's residual stream entering ``start``; the activations of earlier
    blocks are the corrupt run's, ``known`` (name → tensor: the sites and the metric inputs it
    recorded). Returns what :func:`forward_metrics` does: the activations ``site_names`` and each
    metric's per-row values."""
    n_layers = model.n_layers
    wanted = [n for n in {*metric_hooks(metrics), *site_names} if n != LOGITS]
    store = {n: known[n] for n in wanted if hook_layer(n, n_layers) < start}
    rec = [
        (n, partial(save_hook, store=store, key=n))
        for n in wanted
        if hook_layer(n, n_layers) >= start
    ]
    h = _run_blocks(model, resid_in[start], start, last, kwargs, rec)
    if LOGITS in metric_hooks(metrics):
        store[LOGITS] = last_token_logits(model, h, mask)
    values = {k: m(store, mask) for k, m in metrics.items()}
    return {n: store[n] for n in site_names}, values


class _PrefixKV:
    """The corrupt run's keys and values of one block at positions ``< p`` (``[B, kv_head, p,
    d_head]``), as attention's cache: ``update`` returns them, for every group of ``B`` rows,
    followed by the new positions' keys and values, written once into one tensor (a
    ``DynamicCache`` would tile the prefix, then copy it again to concatenate)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values = keys, values

    @staticmethod
    def _join(past: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        B, p = past.shape[0], past.shape[2]
        out = new.new_empty(new.shape[0], new.shape[1], p + new.shape[2], new.shape[3])
        out.view(-1, B, *out.shape[1:])[:, :, :, :p] = past  # every group of B rows
        out[:, :, p:] = new
        return out

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        return self._join(self.keys, keys), self._join(self.values, values)


def _run_suffix(model, suffix, entry: Sequence[int], last: int, p: int, B: int, hooks):
    """Run row groups of ``B`` rows (the corrupt prompts), group ``j`` joining at block
    ``entry[j]`` (ascending) with the corrupt residual stream entering that block, through block
    ``last``; at positions ``p..`` only when ``p > 0``, the earlier keys and values from the corrupt
    run's cache. A cell patched at layer ``L`` cannot change blocks before ``L``, so its rows run
    exactly blocks ``L..last``.

    Returns the last block's output (every group, in order) and ``rows_at(layer)``: how many rows
    the batch held in that block (what a hook there recorded)."""
    kwargs, resid_in, kv = suffix
    T = next(iter(resid_in.values())).shape[1]
    device = next(iter(resid_in.values())).device
    if p:
        kwargs = _slice_kwargs(kwargs, p, T, device)
    memo: dict[tuple, Any] = {}

    def block_kwargs(i: int, k: int) -> dict:
        kw = {}
        for name, v in kwargs[i].items():
            key = (id(v), k)
            if key not in memo:
                memo[key] = (v, _tile(v, k, B))  # keep v alive so its id stays unique
            kw[name] = memo[key][1]
        if p:
            keys, values = kv[i]
            kw["layer_past"] = _PrefixKV(keys[:, :, :p], values[:, :, :p])
        return kw

    joining = collections.Counter(entry)
    present: dict[int, int] = {}
    h, k = None, 0
    with torch.no_grad(), model.bridge.hooks(fwd_hooks=list(hooks)):
        for i in range(min(entry), last + 1):
            if joining.get(i):
                new = _tile(resid_in[i], joining[i], B)[:, p:]
                h = new if h is None else torch.cat([h, new])
                k += joining[i]
            present[i] = k * B
            h = _block(model, i, h, block_kwargs(i, k))
    return h, present.__getitem__


def _block(model: LoadedModel, i: int, h: torch.Tensor, kwargs: Mapping) -> torch.Tensor:
    """Block ``i`` called directly on ``h`` with its captured ``kwargs``: its output stream."""
    out = model.bridge.blocks[i](h, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def _assemble(acts: dict, full: Mapping[str, torch.Tensor], p: int, n: int, rows_at, n_layers):
    """Complete the activations named in ``full`` — recorded at positions ``p..`` of the
    ``rows_at(layer)`` rows present in their block — with the corrupt run's values (the rows that
    join later and the earlier positions are unchanged: attention is causal), in place."""
    for name in full:
        part = acts[name]
        rows = rows_at(hook_layer(name, n_layers))
        whole = full[name].repeat(n, *([1] * (full[name].dim() - 1))).clone()
        if _pos_axis(name) == 2:
            whole[:rows, :, p:] = part
        else:
            whole[:rows, p:] = part
        acts[name] = whole


#: Row-positions (rows × positions run) per block call of a sweep, times ``d_model``: what a chunk
#: holds when the caller gives no ``batch_size``. On one CPU thread a block call of the bundled model
#: (d_model 576) reaches the FLOP rate of a plain 64-row forward from about 1,000 row-positions on;
#: more only costs memory (benchmarks/bench_patching.py, docs/causal_experiments.md).
ROW_POSITIONS_X_D = 4096 * 576


def _schedule(cells: list, start_of, layers: list[int], budget: int, B: int, T: int) -> list:
    """The chunks of a sweep: ``[(p, cells)]``, every cell of a chunk running positions ``p..``
    (``start_of(cell)``), in layer order. Cells are grouped by their start position, so no cell
    pays for an earlier one's positions; a group is split into chunks of at most ``budget``
    row-positions (``B`` rows per cell, ``T − p`` positions each; at least one cell), of equal size,
    in layer order (a cell's rows join at its own layer, so a chunk runs from its first layer)."""
    groups: dict[int, list] = {}
    for c in cells:
        groups.setdefault(int(start_of(c)), []).append(c)
    plan = []
    for p in sorted(groups):
        group = sorted(groups[p], key=lambda c: (layers[c[0]], c))
        per = max(1, budget // (B * (T - p)))
        n = -(-len(group) // per)  # chunks, then as even as they go
        size, extra = divmod(len(group), n)
        i = 0
        for j in range(n):
            k = size + (j < extra)
            plan.append((p, group[i : i + k]))
            i += k
    return plan
