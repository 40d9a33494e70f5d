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
  a chunk: with ``fwd_hooks`` (or ``max_tokens=None``, or ``logits=True``) the batch runs as it is,
  in one forward (to the logits unless ``last_layer`` is given).
* **The unedited prefix.** An edit of block ``s`` (its weights, or a hook inside it) cannot change
  blocks ``0..s−1``: their outputs, and the residual stream entering block ``s``, are those of the
  unedited model. A sweep of edits that all start at or after ``s`` (the weight experiments: swaps,
  patches, ablations of the ME layer's FFN or norm; the WeMask conditions; the cells of an
  activation-patching sweep, from the corrupt run) therefore needs the first ``s`` blocks only once.
  :func:`capture_prefix` runs the model once per chunk and keeps what each block receives (masks,
  rotary embeddings) and the residual stream entering each requested start block;
  ``record(..., prefix=p, start=s)`` then runs blocks ``s..`` only (:func:`run_blocks`), and the
  recorders' statistics of layers ``< s`` are the unedited run's. One check, when it is captured:
  the blocks from the first start must give the forward's last block output, else (``Prefix.why``,
  a warning, an error under :data:`STRICT_ENV`) ``record`` runs the whole forward instead, the one
  fallback. A :class:`Prefix` knows the parameters of the embedding and of blocks ``< s`` as they
  were captured (object and in-place version counter): :meth:`Prefix.check` refuses to reuse it once
  any of them has been replaced or edited in place, so an edit placed before its start block fails
  loudly instead of giving the unedited model's values there.
* **Other backends.** A model of another backend (:mod:`me_interp.backends`: nnsight) has no hooks
  to record from: it computes what a probe asks for in its own traces. The probes an experiment
  calls (``scan_norms``, ``sink_scan``, ``evaluation.sweep``, ...) check :func:`own_backend` and
  hand such a model the call (its method of the same name), so no experiment branches on a backend.

:func:`save_hook` is the plain TransformerLens hook that keeps an activation in a dict (what
``run_with_cache`` does at each hook point).

The simplest recorder, :class:`ResidMidRecorder`, keeps one whole site (``resid_mid`` of every
layer, in the model's dtype and on its device) for the batch: for a measurement that needs the full
vectors of every token afterwards (``weight_input_cross`` feeds them to every layer's FFN path).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol, runtime_checkable

import torch
from jaxtyping import Int

from me_interp import names
from me_interp.loading.align import align
from me_interp.loading.loaded import Batch, LoadedModel

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

    @classmethod
    def whole(cls, batch: Batch) -> Chunk:
        """The whole batch as it is: every row, in order, at its full width."""
        return cls(torch.arange(len(batch)), batch, batch.lengths)


@runtime_checkable
class Recorder(Protocol):
    """Anything that gives, for one chunk, the hooks that record into its own full-batch outputs."""

    def hooks(self, chunk: Chunk) -> list[Hook]: ...


class _Stop(Exception):
    """Raised by the stop hook once every recording hook of the forward has run."""


def _raise_stop(x: torch.Tensor, hook: Any) -> torch.Tensor:
    raise _Stop


def save_hook(x: torch.Tensor, hook: Any, *, store: dict, key: Any) -> torch.Tensor:
    """``store[key] = x.detach()`` (no copy), ``x`` unchanged: bind ``store`` and ``key`` with
    ``functools.partial``. A hook point that fires twice keeps the last value."""
    store[key] = x.detach()
    return x


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
    max_tokens: int | None = MAX_CHUNK_TOKENS,
    prefix: Prefix | None = None,
    start: int = 0,
    logits: bool = False,
) -> torch.Tensor | None:
    """Run ``batch`` (its ``rows``, their first ``upto`` tokens) once, chunk by chunk, with the hooks
    of every recorder (see the module docstring). Recorders write their outputs in place.

    Args:
        model: the loaded model.
        batch: right-padded prompts.
        recorders: the probes to run in this forward.
        rows: the rows to run (default: all).
        upto: per row, how many leading tokens to keep (only for recorders that read positions
            before ``upto``).
        fwd_hooks: interventions built for the whole batch: the batch then runs as it is, in one
            forward, to the logits unless ``last_layer`` is given (``rows`` and ``upto`` must be
            ``None``).
        last_layer: the last block any recorder reads (default: all); the forward stops after it.
        max_tokens: the padded-token budget of a chunk; ``None``: the batch runs as it is, in one
            forward (its rows in order, padding included).
        prefix: the unedited model's block inputs for ``batch`` (:func:`capture_prefix`): run
            blocks ``start..`` only, from the residual stream entering block ``start``, under the
            prefix's own hooks and ``fwd_hooks`` (none before block ``start``); the recorders' hooks
            of earlier layers do not run (their outputs there are the caller's to fill, e.g. from
            the unedited run). When the prefix failed its check (``prefix.why``), the whole forward
            runs instead, chunk by chunk, with the same hooks (same values, slower). ``fwd_hooks``
            and ``logits`` need a prefix of the batch as it is (``max_tokens=None``).
        start: the first block run with ``prefix`` (checked: captured, and no parameter before it
            edited since).
        logits: run the batch as it is to the unembedding and return its logits
            ``[batch pos vocab]`` (what ``model.run_with_hooks`` returns); ``last_layer`` must be
            ``None``.

    Returns:
        The logits with ``logits=True``, else ``None``.
    """
    if logits and last_layer is not None:
        raise ValueError("logits=True runs every block: last_layer must be None")
    if prefix is not None:
        if rows is not None or upto is not None:
            raise ValueError("a prefix run takes the whole batch, with no rows or upto")
        return _from_prefix(model, recorders, fwd_hooks, last_layer, prefix, start, logits)
    if batch.left_padded:  # one forward as padded; the recorders read it right-aligned
        if rows is not None or upto is not None:
            raise ValueError("rows/upto need a right-padded batch (Batch.right_aligned)")
        whole = Chunk.whole(batch.right_aligned())
        hooks = [
            *fwd_hooks,
            *(_aligned(h, batch.starts) for rec in recorders for h in rec.hooks(whole)),
        ]
        stop = (
            None
            if logits or (fwd_hooks and last_layer is None)
            else stop_hook_name(model, last_layer)
        )
        try:
            out = model.run_with_hooks(
                batch, hooks if stop is None else [*hooks, (stop, _raise_stop)]
            )
        except _Stop:
            return None
        return out if logits else None
    if fwd_hooks or logits or max_tokens is None:  # the batch as it is, in one forward
        if rows is not None or upto is not None:
            raise ValueError(
                "rows/upto cannot be combined with fwd_hooks built for the whole batch, logits or "
                "max_tokens=None (the batch as it is)"
            )
        whole = Chunk.whole(batch)
        hooks = [*fwd_hooks, *(h for rec in recorders for h in rec.hooks(whole))]
        if logits:
            return model.run_with_hooks(batch, hooks)
        to_logits = bool(fwd_hooks) and last_layer is None
        stop = None if to_logits else stop_hook_name(model, last_layer)
        try:  # the stop hook registered last: it runs after the recorders' hooks
            model.run_with_hooks(batch, hooks if stop is None else [*hooks, (stop, _raise_stop)])
        except _Stop:
            pass
        return None
    stop = stop_hook_name(model, last_layer)
    for chunk in chunks(batch, rows, upto, max_tokens):
        hooks = [h for rec in recorders for h in rec.hooks(chunk)]
        if stop is not None:
            hooks.append((stop, _raise_stop))  # registered last: runs after the recorders' hooks
        try:
            model.run_with_hooks(chunk.batch, hooks)
        except _Stop:
            pass
    return None


def _read_aligned(x: torch.Tensor, hook: Any, *, fn: Any, starts: Sequence[int]) -> torch.Tensor:
    """Run the recorder hook ``fn`` on ``x`` with every row's real tokens moved to index 0 (an
    attention pattern along its query and key axes); ``x`` goes on unchanged (recorders read)."""
    pattern = hook.name.endswith(("hook_pattern", "hook_attn_scores"))  # [batch head q k]
    fn(align(x, starts, (2, 3) if pattern else (1,)), hook)
    return x


def _aligned(hook: Hook, starts: Sequence[int]) -> Hook:
    """A recorder's ``(name, fn)`` for a left-padded forward: ``fn`` reads it right-aligned."""
    name, fn = hook
    return name, partial(_read_aligned, fn=fn, starts=list(starts))


# ------------------------------------------------------------------------------------------
# running blocks directly: the unedited prefix, computed once and reused
# ------------------------------------------------------------------------------------------

_DROP = ("cache", "past_key_value", "past_key_values", "layer_past", "use_cache", "cache_position")
"""Block keyword arguments that belong to one forward's cache, not to the block's input."""

STRICT_ENV = "ME_INTERP_STRICT"
"""Environment variable: when set (not ``""``/``"0"``), a shortcut that cannot be used (a prefix that
fails its check, a position suffix) raises instead of warning and falling back (tests set it)."""


def strict() -> bool:
    """Whether a fallback to full forwards raises (:data:`STRICT_ENV` set to anything but ``""`` or
    ``"0"``; the test suite sets it) instead of warning."""
    return os.environ.get(STRICT_ENV, "") not in ("", "0")


def give_up(msg: str, err: BaseException | None = None, stacklevel: int = 4) -> None:
    """A shortcut (a reused prefix, a position suffix) that cannot be used: a ``RuntimeWarning``
    that the run falls back to full forwards, or under :func:`strict` an error."""
    if strict():
        raise RuntimeError(f"{msg} [{STRICT_ENV} is set]") from err
    warnings.warn(msg, RuntimeWarning, stacklevel=stacklevel)


def block_inputs(
    model: LoadedModel, batch: Batch, hooks: Sequence, starts: Sequence[int], cache: Any = None
):
    """One forward of ``batch`` under ``hooks``, stopped before the unembedding: the keyword
    arguments each block receives (masks, rotary embeddings), per block — Gemma 2/3 give
    sliding-window and global layers their own mask and rotary embedding —, and the residual
    stream entering each of ``starts`` and the last block's output (key ``-1``).

    ``cache``: a ``transformers`` cache (e.g. an empty ``DynamicCache``) handed to every block's
    attention as ``layer_past``, which appends the keys and values it computes (after rotary
    embeddings) to it; appending to an empty cache leaves the forward's values unchanged. The
    caller then has the keys and values of every block of this forward (``cache.layers[i]``) without
    running the blocks again.
    """
    got: dict[int, dict] = {}

    def pre(module, args, kwargs, *, i):
        got.setdefault(i, kwargs)
        return None if cache is None else (args, {**kwargs, "layer_past": cache})

    last = model.n_layers - 1
    store: dict[int, torch.Tensor] = {}
    rec = [(names.resid_pre(x), partial(save_hook, store=store, key=x)) for x in set(starts)]
    rec.append((names.resid_post(last), partial(save_hook, store=store, key=-1)))
    handles = [
        block.register_forward_pre_hook(partial(pre, i=i), with_kwargs=True)
        for i, block in enumerate(model.bridge.blocks)
    ]
    stop = stop_hook_name(model)
    try:
        model.run_with_hooks(
            batch, [*hooks, *rec, *([] if stop is None else [(stop, _raise_stop)])]
        )
    except _Stop:
        pass
    finally:
        for h in handles:
            h.remove()
    kwargs = {i: {k: v for k, v in kw.items() if k not in _DROP} for i, kw in got.items()}
    return kwargs, store


def run_blocks(
    model: LoadedModel, resid: torch.Tensor, start: int, stop: int, kwargs: Mapping, hooks
) -> torch.Tensor:
    """Run blocks ``start..stop`` (inclusive) on ``resid`` with ``hooks`` and each block's own
    captured ``kwargs[i]``; earlier blocks skipped. Returns block ``stop``'s output."""
    with torch.no_grad(), model.bridge.hooks(fwd_hooks=list(hooks)):
        h = resid
        for i in range(start, stop + 1):
            out = model.bridge.blocks[i](h, **kwargs[i])
            h = out[0] if isinstance(out, tuple) else out
    return h


def final_logits(model: LoadedModel, h: torch.Tensor) -> torch.Tensor:
    """The logits from the last block's output ``h`` (``[batch pos d_model]``): the final norm and
    the unembedding, and a final logit soft-cap where the model has one (Gemma 2)."""
    bridge = model.bridge
    with torch.no_grad():
        logits = bridge.unembed(bridge.ln_final(h))
    cap = getattr(model.hf.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def _params_before(model: LoadedModel, start: int) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters a run from block ``start`` takes as given: every parameter of the model
    outside blocks ``start..`` (the embedding, blocks ``< start``; the final norm and unembedding
    are not run by a prefix run but belong to the same unedited model)."""
    later = {
        id(p) for i in range(start, model.n_layers) for p in model.bridge.blocks[i].parameters()
    }
    return [(n, p) for n, p in model.hf.named_parameters() if id(p) not in later]


@dataclass
class Prefix:
    """The block inputs of one batch's forward (under ``hooks``), per chunk (:func:`chunks`).

    Attributes:
        starts: the blocks a run may start at.
        chunks: the chunks, as :func:`chunks` makes them for the batch (one, the batch as it is,
            with ``max_tokens=None``).
        kwargs: per chunk, per block, the keyword arguments that block received.
        resid: per chunk, per start block, the residual stream entering it.
        hooks: the hooks the forward ran under (a run from a start block runs them too).
        why: why running blocks from the first start did not reproduce the forward (then
            :func:`record` runs the whole forward instead), ``None`` when it did.
    """

    model: LoadedModel
    starts: tuple[int, ...]
    chunks: list[Chunk]
    kwargs: list[dict[int, dict]]
    resid: list[dict[int, torch.Tensor]]
    hooks: tuple = ()
    why: str | None = None
    _versions: dict[int, list[tuple[str, int, int]]] = field(default_factory=dict, repr=False)

    @property
    def whole(self) -> bool:
        """Whether the prefix is of the batch as it is (one chunk: every row, in order)."""
        return len(self.chunks) == 1 and bool(
            torch.equal(self.chunks[0].rows, torch.arange(len(self.chunks[0])))
        )

    def check(self, model: LoadedModel, start: int) -> None:
        """Raise ``RuntimeError`` unless a run from ``start`` is valid: ``start`` was captured, for
        this model, whose parameters before ``start`` are still those captured (the same objects,
        not edited in place)."""
        if model is not self.model:
            raise RuntimeError("this prefix was captured on another model")
        if start not in self.starts:
            raise RuntimeError(f"no prefix captured for block {start} (captured: {self.starts})")
        params = _params_before(model, start)  # one walk of the module tree per check
        held = [n for n, p in params if getattr(p, EDITED_ATTR, 0)]
        now = _fingerprint(params)
        if not held and now != self._versions[start]:
            held = [next(a[0] for a, b in zip(self._versions[start], now) if a != b)]
        if held:
            raise RuntimeError(
                f"{held[0]} was edited after the prefix was captured: an edit before block "
                f"{start} changes the blocks a run from {start} takes from the unedited model"
            )


EDITED_ATTR = "_me_interp_edited"
"""Set on a parameter while an ``me_interp.edits`` edit holds it (``edits.core.EDITED_ATTR``)."""


def _fingerprint(params: list[tuple[str, torch.nn.Parameter]]) -> list[tuple[str, int, int]]:
    """Per parameter of :func:`_params_before`: its name, object and version counter (an in-place
    write through the parameter itself bumps it; ``me_interp.edits`` marks its edits instead)."""
    return [(n, id(p), p._version) for n, p in params]


def capture_prefix(
    model: LoadedModel,
    batch: Batch,
    starts: Sequence[int],
    max_tokens: int | None = MAX_CHUNK_TOKENS,
    fwd_hooks: Sequence[Hook] = (),
) -> Prefix:
    """One forward per chunk of ``batch`` under ``fwd_hooks`` (none: the unedited model), stopped
    before the unembedding: what :func:`run_blocks` needs to run any of the blocks ``starts``
    onward (see the module docstring, *The unedited prefix*).

    The one check: blocks ``min(starts)..`` run from the captured inputs (under ``fwd_hooks``)
    must give the forward's last block output (rtol 1e-4, atol 1e-5), chunk by chunk. Where they do
    not (or raise), ``why`` says so, a ``RuntimeWarning`` (under :data:`STRICT_ENV` an error) says
    that runs from this prefix are full forwards, and :func:`record` runs those.

    Args:
        max_tokens: as :func:`record`'s (``None``: the batch as it is, one chunk).
        fwd_hooks: hooks built for the whole batch (then ``max_tokens`` must be ``None``).
    """
    starts = tuple(sorted({model.check_layer(int(s)) for s in starts}))
    if not starts:
        raise ValueError("capture_prefix needs at least one start block")
    if fwd_hooks and max_tokens is not None:
        raise ValueError("a prefix under fwd_hooks built for the whole batch needs max_tokens=None")
    cs = [Chunk.whole(batch)] if max_tokens is None else chunks(batch, max_tokens=max_tokens)
    kwargs, resid, ends = [], [], []
    for c in cs:  # every block runs (each one's kwargs are needed); the unembedding does not
        kw, res = block_inputs(model, c.batch, fwd_hooks, starts)
        kwargs.append(kw)
        ends.append(res.pop(-1))
        resid.append(res)
    first, last = starts[0], model.n_layers - 1
    why, err = None, None
    try:
        for c in range(len(cs)):
            h = run_blocks(model, resid[c][first], first, last, kwargs[c], fwd_hooks)
            a, b = h.float(), ends[c].float()
            if a.shape != b.shape or not torch.allclose(a, b, rtol=1e-4, atol=1e-5):
                gap = float("nan") if a.shape != b.shape else float((a - b).abs().max())
                why = (
                    f"running blocks {first}..{last} directly gave the last block's output up to "
                    f"{gap:.3g} away from the full forward"
                )
                break
    except (TypeError, ValueError, RuntimeError, KeyError, AttributeError, IndexError) as e:
        why, err = f"running blocks {first}..{last} directly failed: {type(e).__name__}: {e}", e
    if why is not None:
        give_up(
            f"runs from this prefix fall back to full forwards (slower, same values): {why}", err
        )
    # after the check's run (an offloaded block's weights are swapped in as it runs)
    versions = {s: _fingerprint(_params_before(model, s)) for s in starts}
    return Prefix(model, starts, cs, kwargs, resid, tuple(fwd_hooks), why, versions)


def _from_prefix(model, recorders, fwd_hooks, last_layer, prefix: Prefix, start: int, logits: bool):
    """:func:`record` from ``prefix``: blocks ``start..`` only, or (``prefix.why``) the whole
    forward per chunk, under the prefix's hooks and ``fwd_hooks``."""
    prefix.check(model, start)
    if (fwd_hooks or logits) and not prefix.whole:
        raise ValueError(
            "fwd_hooks or logits need a prefix of the batch as it is (max_tokens=None)"
        )
    early = [n for n, _ in fwd_hooks if (block_of(n) is None or block_of(n) < start)]
    if early:
        raise ValueError(f"a run from block {start} cannot apply hooks before it: {early}")
    last = model.n_layers - 1 if last_layer is None else model.check_layer(last_layer)
    out = None
    for c, chunk in enumerate(prefix.chunks):
        hooks = [*prefix.hooks, *fwd_hooks, *(h for rec in recorders for h in rec.hooks(chunk))]
        if prefix.why is not None:  # the one fallback: the whole forward
            stop = None if logits else stop_hook_name(model, last)
            try:
                out = model.run_with_hooks(
                    chunk.batch, [*hooks, *([] if stop is None else [(stop, _raise_stop)])]
                )
            except _Stop:
                pass
            continue
        h = run_blocks(model, prefix.resid[c][start], start, last, prefix.kwargs[c], hooks)
        if logits:
            out = final_logits(model, h)
    return out if logits else None


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


def block_of(name: str) -> int | None:
    """The block a hook point is in (``blocks.L.…``), ``None`` outside the blocks (the embedding,
    the final norm, the unembedding)."""
    parts = name.split(".")
    return int(parts[1]) if len(parts) > 2 and parts[0] == "blocks" and parts[1].isdigit() else None


__all__ = [
    "EDITED_ATTR",
    "MAX_CHUNK_TOKENS",
    "Chunk",
    "Prefix",
    "Recorder",
    "ResidMidRecorder",
    "STRICT_ENV",
    "block_of",
    "capture_prefix",
    "chunks",
    "final_logits",
    "give_up",
    "own_backend",
    "record",
    "run_blocks",
    "save_hook",
    "stop_hook_name",
    "strict",
]
