"""Running blocks directly: the unedited prefix of a forward pass, computed once and reused.

An edit of block ``s`` (its weights, or a hook inside it) cannot change blocks ``0..s−1``: their
outputs, and the residual stream entering block ``s``, are those of the unedited model. A sweep of
edits that all start at or after ``s`` (the weight experiments: swaps, patches, ablations of the ME
layer's FFN or norm) therefore needs the first ``s`` blocks only once. :func:`capture_prefix` runs the
unedited model once per chunk (``probes.batching``) and keeps what each block receives (masks, rotary
embeddings: :func:`capture_block_inputs`) and the residual stream entering each requested start
block; ``probes.batching.record(..., prefix=p, start=s)`` then runs blocks ``s..`` only
(:func:`run_blocks`), and the recorders' statistics of layers ``< s`` are the unedited run's.

A :class:`Prefix` knows the parameters of the embedding and of blocks ``< s`` as they were captured
(object and in-place version counter): :meth:`Prefix.check` refuses to reuse it once any of them has
been replaced or edited in place, so an edit placed before its start block fails loudly instead of
giving the unedited model's values there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch

from me_interp import names
from me_interp.loading.loaded import Batch, LoadedModel
from me_interp.probes.batching import MAX_CHUNK_TOKENS, chunks, stop_hook_name

_DROP = ("cache", "past_key_value", "past_key_values", "use_cache", "cache_position")
"""Block keyword arguments that belong to one forward's cache, not to the block's input."""


def _record(x: torch.Tensor, hook, *, store: dict, key: str):
    store[key] = x.detach()
    return x


class _Stop(Exception):
    pass


def _raise_stop(x: torch.Tensor, hook) -> torch.Tensor:
    raise _Stop


def capture_block_inputs(
    model: LoadedModel,
    batch: Batch,
    hooks: Sequence,
    layers: Sequence[int],
    stop: str | None = None,
):
    """One forward of ``batch`` under ``hooks``: the keyword arguments each block receives (masks,
    rotary embeddings), per block — Gemma 2/3 give sliding-window and global layers their own mask
    and rotary embedding — and the residual stream entering each of ``layers``. ``stop``: a hook
    point after the last block where the forward may end (no unembedding)."""
    got: dict[int, dict] = {}

    def pre(module, args, kwargs, *, i):
        got.setdefault(i, kwargs)

    store: dict[str, torch.Tensor] = {}
    rec = [(names.resid_pre(x), partial(_record, store=store, key=str(x))) for x in set(layers)]
    handles = [
        block.register_forward_pre_hook(partial(pre, i=i), with_kwargs=True)
        for i, block in enumerate(model.bridge.blocks)
    ]
    ends = [] if stop is None else [(stop, _raise_stop)]
    try:
        model.run_with_hooks(batch, [*hooks, *rec, *ends])
    except _Stop:
        pass
    finally:
        for h in handles:
            h.remove()
    kwargs = {i: {k: v for k, v in kw.items() if k not in _DROP} for i, kw in got.items()}
    return kwargs, {int(k): v for k, v in store.items()}


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
    """The unedited model's block inputs, per chunk of one batch (``probes.batching.chunks``).

    Attributes:
        starts: the blocks a run may start at.
        chunks: the chunks, as :func:`probes.batching.chunks` makes them for the batch.
        kwargs: per chunk, per block, the keyword arguments that block received.
        resid: per chunk, per start block, the residual stream entering it.
    """

    model: LoadedModel
    starts: tuple[int, ...]
    chunks: list
    kwargs: list[dict[int, dict]]
    resid: list[dict[int, torch.Tensor]]
    _versions: dict[int, list[tuple[str, int, int]]] = field(default_factory=dict, repr=False)

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
    max_tokens: int | None = None,
) -> Prefix:
    """One unedited forward per chunk of ``batch``: what :func:`run_blocks` needs to run any of the
    blocks ``starts`` onward (see the module docstring)."""
    starts = tuple(sorted({model.check_layer(int(s)) for s in starts}))
    if not starts:
        raise ValueError("capture_prefix needs at least one start block")
    cs = chunks(batch, max_tokens=MAX_CHUNK_TOKENS if max_tokens is None else max_tokens)
    stop = stop_hook_name(model)  # after the last block: no unembedding
    kwargs, resid = [], []
    for c in cs:  # every block runs (each one's kwargs are needed); the unembedding does not
        kw, res = capture_block_inputs(model, c.batch, [], starts, stop=stop)
        kwargs.append(kw)
        resid.append(res)
    versions = {s: _fingerprint(_params_before(model, s)) for s in starts}
    return Prefix(model, starts, cs, kwargs, resid, versions)


__all__ = ["Prefix", "capture_block_inputs", "capture_prefix", "run_blocks"]
