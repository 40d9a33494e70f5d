"""Running probes: several probes in one forward pass, over length-sorted chunks, without logits.

A *recorder* measures something during a forward pass. It allocates its outputs for the whole batch
once and, for each :class:`Chunk` of the batch, returns the TransformerLens hooks that write that
chunk's rows (``out[layer, chunk.rows, :chunk.width] = ...``). :func:`record` runs one forward per
chunk with the hooks of every recorder, so probes that need the same forward share it.

* **Chunks.** A batch is right-padded to its longest prompt, so with prompts of 16–256 tokens most of
  one padded batch is padding. :func:`chunks` sorts the prompts by length and groups them into chunks
  of at most ``max_tokens`` padded tokens, each trimmed to its own longest prompt. Per-token values
  are the same (causal attention with a padding mask: padding never reaches a real token), at a
  fraction of the cost.
* **No logits.** Probes read activations inside the blocks, so the forward stops at the input of the
  final norm (``ln_final.hook_in``, when the bridge has it) and skips the unembedding, or right after
  the block ``last_layer`` when only the first layers are needed.
* **Prefixes.** ``upto[b]`` keeps only the first ``upto[b]`` tokens of prompt ``b``. With causal
  attention a token's state depends only on the tokens up to it, so a recorder that reads one position
  ``m_b`` per prompt gets the same values from the prefix of ``m_b + 1`` tokens.
* **Interventions.** ``fwd_hooks`` built for the whole batch (per-prompt positions, …) are not valid on
  a chunk: with ``fwd_hooks`` the batch runs as it is, in one forward, to the logits.
* **Other backends.** A model of another backend (:mod:`me_interp.backends`: nnsight) has no hooks
  to record from: it computes what a probe asks for in its own traces. The probes an experiment
  calls (``scan_norms``, ``sink_scan``, ``evaluation.sweep``, ...) check :func:`own_backend` and
  hand such a model the call (its method of the same name), so no experiment branches on a backend.

The simplest recorder, :class:`ResidMidRecorder`, keeps one whole site (``resid_mid`` of every
layer, in the model's dtype and on its device) for the batch: for a measurement that needs the full
vectors of every token afterwards (``weight_input_cross`` feeds them to every layer's FFN path).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from jaxtyping import Int

from me_interp import names
from me_interp.models import Batch, LoadedModel

if TYPE_CHECKING:
    from me_interp.probes.blocks import Prefix

MAX_CHUNK_TOKENS = 1024
"""Padded tokens per chunk (rows × longest row). Measured on SmolLM2-135M with one CPU thread, the 82
built-in prompts of 23–243 tokens (4206 tokens): one padded batch of 19 926 tokens 58 s; chunks of 1024
(6 chunks, 4837 tokens) 9 s; chunks of 512 or 2048 were not faster (no logits in either case)."""

HookFn = Callable[..., Any]
Hook = tuple[str, HookFn]


def own_backend(model: Any) -> bool:
    """Whether ``model`` runs on another backend than TransformerLens (``model.backend``, e.g. the
    nnsight backend's model): it then measures in its own traces what a probe asks for, through its
    method of the probe's name."""
    return getattr(model, "backend", "tl") != "tl"


@dataclass(frozen=True)
class Chunk:
    """Some rows of a batch, run together.

    Attributes:
        rows: indices of the rows in the full batch (CPU ``long``).
        batch: those rows, trimmed to the longest of them (on the model's device).
        lengths: real tokens of each row in this chunk (after ``upto``).
    """

    rows: Int[torch.Tensor, " n"]
    batch: Batch
    lengths: list[int]

    @property
    def width(self) -> int:
        return int(self.batch.tokens.shape[1])

    def __len__(self) -> int:
        return int(self.rows.shape[0])


@runtime_checkable
class Recorder(Protocol):
    """Anything that gives, for one chunk, the hooks that record into its own full-batch outputs."""

    def hooks(self, chunk: Chunk) -> list[Hook]: ...


class _Stop(Exception):
    """Raised by the stop hook once every recording hook of the forward has run."""


def _raise_stop(x: torch.Tensor, hook: Any) -> torch.Tensor:
    raise _Stop


def chunks(
    batch: Batch,
    rows: Sequence[int] | None = None,
    upto: Sequence[int] | None = None,
    max_tokens: int = MAX_CHUNK_TOKENS,
) -> list[Chunk]:
    """Split ``batch`` (or its ``rows``) into length-sorted chunks of at most ``max_tokens`` padded
    tokens (a single row longer than that is a chunk of its own).

    Args:
        batch: right-padded prompts.
        rows: the rows to run (default: all), in any order.
        upto: per row of the *full* batch, how many leading tokens to keep (``None``: all).
        max_tokens: the padded-token budget of a chunk.

    Raises:
        ValueError: ``max_tokens < 1``, a row index out of range, or an ``upto`` outside ``[1, length]``.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    lengths = batch.lengths
    picked = list(range(len(batch))) if rows is None else [int(r) for r in rows]
    for r in picked:
        if not 0 <= r < len(batch):
            raise ValueError(f"row {r} is out of range for {len(batch)} prompts")
    if upto is not None and len(upto) != len(batch):
        raise ValueError(f"upto has {len(upto)} entries for {len(batch)} prompts")
    n = {}
    for r in picked:
        keep = lengths[r] if upto is None else int(upto[r])
        if not 1 <= keep <= lengths[r]:
            raise ValueError(f"upto[{r}] = {keep} is outside [1, {lengths[r]}]")
        n[r] = keep
    groups: list[list[int]] = []
    for r in sorted(picked, key=lambda r: (n[r], r)):  # ascending: the last row is the widest
        if groups and (len(groups[-1]) + 1) * n[r] <= max_tokens:
            groups[-1].append(r)
        else:
            groups.append([r])
    out = []
    for g in groups:
        idx = torch.tensor(g, dtype=torch.long)
        width = max(n[r] for r in g)
        dev = batch.tokens.device
        tokens = batch.tokens[idx.to(dev), :width].clone()
        mask = batch.attention_mask[idx.to(dev), :width].clone()
        for i, r in enumerate(g):
            mask[i, n[r] :] = 0
        prompts = None if batch.prompts is None else tuple(batch.prompts[r] for r in g)
        out.append(Chunk(rows=idx, batch=Batch(tokens, mask, prompts), lengths=[n[r] for r in g]))
    return out


def stop_hook_name(model: LoadedModel, last_layer: int | None = None) -> str | None:
    """Where a forward can stop once the blocks up to ``last_layer`` (default: all) have run."""
    last = model.n_layers - 1 if last_layer is None else model.check_layer(last_layer)
    name = names.resid_pre(last + 1) if last + 1 < model.n_layers else "ln_final.hook_in"
    return name if name in model.bridge.hook_dict else None


def record(
    model: LoadedModel,
    batch: Batch,
    recorders: Sequence[Recorder],
    *,
    rows: Sequence[int] | None = None,
    upto: Sequence[int] | None = None,
    fwd_hooks: Sequence[Hook] = (),
    last_layer: int | None = None,
    max_tokens: int = MAX_CHUNK_TOKENS,
    prefix: Prefix | None = None,
    start: int = 0,
) -> None:
    """Run ``batch`` (its ``rows``, their first ``upto`` tokens) once, chunk by chunk, with the hooks
    of every recorder (see the module docstring). Recorders write their outputs in place.

    Args:
        model: the loaded model.
        batch: right-padded prompts.
        recorders: the probes to run in this forward.
        rows: the rows to run (default: all).
        upto: per row, how many leading tokens to keep (only for recorders that read positions
            before ``upto``).
        fwd_hooks: interventions built for the whole batch: the batch then runs unchunked, to the
            logits (``rows`` and ``upto`` must be ``None``).
        last_layer: the last block any recorder reads (default: all); the forward stops after it.
        max_tokens: the padded-token budget of a chunk.
        prefix: the unedited model's block inputs for ``batch`` (:func:`me_interp.probes.blocks.
            capture_prefix`, same ``max_tokens``): run blocks ``start..`` only, from the unedited
            residual stream entering block ``start``; the recorders' hooks of earlier layers do not
            run (their outputs there are the caller's to fill, e.g. from the unedited run).
        start: the first block run with ``prefix`` (checked: captured, and no parameter before it
            edited since).
    """
    if fwd_hooks:
        if rows is not None or upto is not None:
            raise ValueError(
                "rows/upto cannot be combined with fwd_hooks built for the whole batch"
            )
        whole = Chunk(torch.arange(len(batch)), batch, batch.lengths)
        hooks = [h for rec in recorders for h in rec.hooks(whole)]
        model.run_with_hooks(batch, [*fwd_hooks, *hooks])
        return
    if prefix is not None:
        if rows is not None or upto is not None or fwd_hooks:
            raise ValueError("a prefix run takes the whole batch, with no rows, upto or fwd_hooks")
        from me_interp.probes.blocks import run_blocks  # blocks builds on this module

        prefix.check(model, start)
        last = model.n_layers - 1 if last_layer is None else model.check_layer(last_layer)
        for c, chunk in enumerate(prefix.chunks):
            hooks = [h for rec in recorders for h in rec.hooks(chunk)]
            run_blocks(model, prefix.resid[c][start], start, last, prefix.kwargs[c], hooks)
        return
    stop = stop_hook_name(model, last_layer)
    for chunk in chunks(batch, rows, upto, max_tokens):
        hooks = [h for rec in recorders for h in rec.hooks(chunk)]
        if stop is not None:
            hooks.append((stop, _raise_stop))  # registered last: runs after the recorders' hooks
        try:
            model.run_with_hooks(chunk.batch, hooks)
        except _Stop:
            pass


class ResidMidRecorder:
    """Keeps ``resid_mid`` of every layer for the whole batch (the model's dtype and device), chunk
    by chunk (:func:`record`): ``out[layer, b, t]`` (read only the real tokens: padding holds whatever
    its chunk computed there, or zeros)."""

    def __init__(self, model: LoadedModel, batch: Batch) -> None:
        B, T = batch.tokens.shape
        self.model = model
        self.out = torch.zeros(
            model.n_layers, B, T, model.d_model, dtype=model.dtype, device=model.device
        )

    def hooks(self, chunk: Chunk) -> list:
        rows = chunk.rows.to(self.model.device)
        keep = partial(self._keep, rows=rows, width=chunk.width)
        return [(names.resid_mid(y), partial(keep, layer=y)) for y in range(self.model.n_layers)]

    def _keep(self, x, hook, *, layer, rows, width):
        self.out[layer, rows, :width] = x.detach().to(self.out.dtype)
        return x


__all__ = [
    "MAX_CHUNK_TOKENS",
    "Chunk",
    "Recorder",
    "ResidMidRecorder",
    "chunks",
    "own_backend",
    "record",
    "stop_hook_name",
]
