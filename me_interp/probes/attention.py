"""Attention probes: how much attention goes to given key positions (the sink), and its entropy.

For layer l, head h, prompt b:

* ``to_positions[l, b, h] = Σ_{p∈P_b} mean_{q>p} A[q, p]`` — attention mass on the positions ``P_b``
  (default ``{0}``: the first token), each position averaged over the real queries *after* it (the
  only ones that can see it, as ``patching.SinkMass``; a position needs a real token after it);
* ``entropy[l, b, h] = mean_{q≥1} ( −Σ_k A[q, k] log A[q, k] )`` in nats over the real queries
  ``q ≥ 1`` (query 0 can only attend to itself; uniform over n keys: ``log n``).

Patterns come from ``blocks.L.attn.hook_pattern`` (eager attention), one forward, no full cache.
:class:`AttentionRecorder` keeps ``to_key[l, b, h, k] = mean_{q>k} A[q, k]`` for *every* key ``k``
(NaN where no real query follows ``k``), so the statistics of any positions chosen after the forward
(the detected massive tokens) are sums over it.

:func:`attention_probe` adds, per layer and head (paper.md §3; Gu et al. 2024, "When attention sink
emerges"):

* ``to_ref[l, b, h] = mean_{q>m_b} A[q, m_b]``: mean attention to the massive token ``m_b`` of prompt
  ``b`` (position 0 by default) from the queries after it, and ``to_each[p]`` the same for each
  massive position ``p`` (NaN for prompts where ``p`` is not massive or is the last token);
* sink rate ``sink_rate[l] = mean_{b,h} 1[to_ref[l, b, h] > ε]`` (ε = 0.3): the share of heads whose mean
  attention to the token exceeds ε, averaged over prompts; ``head_sink_rate[l, h]`` per head;
* BOS-attention metric ``bos[l, b, h] = mean_{q ≥ ⌊n_b/2⌋, q≥1} A[q, 0]``: mean attention from the
  second half of the queries to position 0 (``n_b`` real tokens);
* ``entropy`` as above.

:class:`SinkRecorder` keeps only the mass on positions known before the forward,
``out[l, b, h] = Σ_{p∈P_b} mean_{q>p} A[q, p]`` (the sink of the weight experiments' one-forward
measurement). :func:`attention_src_dst` reads, for two given positions ``src`` and ``dst`` (the
massive token and the token a transplant writes it into), ``mean_{q>max(src,dst)} A[q, src]`` and
``A[q, dst]`` per layer, prompt and head, from the same queries, under any intervention hooks, with
the norm ratios ``‖h_t‖ / mean_{t'≠t} ‖h_t'‖`` of both at one layer's output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch
from jaxtyping import Bool, Float

from me_interp import names
from me_interp.loading.inputs import Prompts, as_batch
from me_interp.models import Batch, LoadedModel
from me_interp.probes.activations import Activations
from me_interp.probes.batching import Chunk, record
from me_interp.probes.norms import ratio_to_others


@dataclass(frozen=True)
class AttentionStats:
    """Per-layer, per-prompt, per-head attention statistics (see module docstring)."""

    to_positions: Float[torch.Tensor, "layer batch head"]
    entropy: Float[torch.Tensor, "layer batch head"]
    positions: list[list[int]]

    def mean_to_positions(self) -> list[float]:
        """Per layer: mean over prompts and heads of the attention mass on the positions."""
        return self.to_positions.mean((1, 2)).tolist()

    def mean_entropy(self) -> list[float]:
        return self.entropy.mean((1, 2)).tolist()


def attention_entropy(
    pattern: Float[torch.Tensor, "*lead key"],
) -> Float[torch.Tensor, "*lead"]:
    """``−Σ_k A_k log A_k`` in nats along the last dim (``0 log 0 = 0``)."""
    a = pattern.float()
    return -(a * torch.log(a.clamp_min(1e-30))).sum(-1)


def sink_rate(
    to_token: Float[torch.Tensor, "layer batch head"], eps: float = 0.3
) -> Float[torch.Tensor, " layer"]:
    """Share of (prompt, head) pairs per layer whose mean attention to the token exceeds ``eps``."""
    if not 0.0 <= eps < 1.0:
        raise ValueError(f"eps must be in [0, 1), got {eps}")
    return (to_token > eps).float().mean((1, 2))


def head_sink_rate(
    to_token: Float[torch.Tensor, "layer batch head"], eps: float = 0.3
) -> Float[torch.Tensor, "layer head"]:
    """Per layer and head: share of prompts whose mean attention to the token exceeds ``eps``."""
    if not 0.0 <= eps < 1.0:
        raise ValueError(f"eps must be in [0, 1), got {eps}")
    return (to_token > eps).float().mean(1)


def _query_mask(batch: Batch) -> torch.Tensor:
    q = batch.attention_mask.bool().clone()
    q[:, 0] = False
    if not q.any(-1).all():
        raise ValueError("attention statistics need prompts with at least 2 tokens")
    return q


def mean_to_keys(
    pattern: Float[torch.Tensor, "batch head query_pos key_pos"],
    query_mask: Bool[torch.Tensor, "batch query_pos"],
) -> Float[torch.Tensor, "batch head key_pos"]:
    """``mean_{q>k, q real} A[q, k]`` for every key ``k``: each key's attention from the real queries
    after it (the ones that can see it). NaN where no real query follows ``k``."""
    T = pattern.shape[-1]
    later = torch.ones(T, T, dtype=torch.bool, device=pattern.device).tril(-1)  # [q k]: q > k
    after = (query_mask.to(pattern.device)[:, :, None] & later).to(pattern.dtype)  # [batch q k]
    return torch.einsum("bhqk,bqk->bhk", pattern, after) / after.sum(1)[:, None, :]


class AttentionRecorder:
    """Records, per layer, prompt and head, the mean attention to every key position from the real
    queries after it (``to_key[l, b, h, k] = mean_{q>k} A[q, k]``, NaN where none follows), the
    attention entropy (queries ``q ≥ 1``), and the BOS metric (queries of the second half to position
    0), chunk by chunk (``probes.batching``). Everything the sink statistics of
    :class:`AttentionProbe` need for *any* massive positions, chosen afterwards."""

    def __init__(self, model: LoadedModel, batch: Batch) -> None:
        qmask = _query_mask(batch)
        L, H, (B, T) = model.n_layers, model.n_heads, batch.tokens.shape
        self.model, self.batch = model, batch
        self.to_key = torch.full((L, B, H, T), float("nan"))
        self.entropy = torch.zeros(L, B, H)
        self.bos = torch.zeros(L, B, H)
        self._qmask = qmask.cpu()

    def hooks(self, chunk: Chunk) -> list:
        dev = self.model.device
        w = chunk.width
        qmask = self._qmask[chunk.rows, :w].clone()
        bosq = qmask.clone()
        for i, n in enumerate(chunk.lengths):
            bosq[i, : n // 2] = False
        fn = partial(self._record, chunk=chunk, qmask=qmask.to(dev), bosq=bosq.to(dev))
        return [
            (names.pattern(layer), partial(fn, layer=layer)) for layer in range(self.model.n_layers)
        ]

    def _record(self, pattern, hook, *, layer, chunk: Chunk, qmask, bosq):
        a = pattern.detach().float()  # [n head q k]
        qm = qmask[:, None, :].to(a.dtype)  # [n 1 q]
        n = qm.sum(-1)  # [n 1]
        bq = bosq[:, None, :].to(a.dtype)
        rows, w = chunk.rows, chunk.width
        self.to_key[layer, rows, :, :w] = mean_to_keys(a, qmask).cpu()
        self.entropy[layer, rows] = ((attention_entropy(a) * qm).sum(-1) / n).cpu()
        self.bos[layer, rows] = ((a[..., 0] * bq).sum(-1) / bq.sum(-1)).cpu()
        return pattern

    def mass_on(
        self, positions: Sequence[Sequence[int]]
    ) -> Float[torch.Tensor, "layer batch head"]:
        """``Σ_{p∈P_b} mean_{q>p} A[q, p]`` per layer, prompt and head."""
        key_mask = _key_mask(self.batch, positions)
        return torch.einsum("lbhk,bk->lbh", self.to_key.nan_to_num(0.0), key_mask)

    def probe(
        self,
        reference: Sequence[int] | None = None,
        massive_positions: Sequence[Sequence[int]] | None = None,
        eps: float = 0.3,
    ) -> AttentionProbe:
        """The :class:`AttentionProbe` for these massive tokens (see :func:`attention_probe`)."""
        if not 0.0 <= eps < 1.0:
            raise ValueError(f"eps must be in [0, 1), got {eps}")
        B = len(self.batch)
        ref = [0] * B if reference is None else [int(p) for p in reference]
        if len(ref) != B:
            raise ValueError(f"reference has {len(ref)} positions for {B} prompts")
        mpos = (
            [[r] for r in ref]
            if massive_positions is None
            else [list(p) for p in massive_positions]
        )
        if len(mpos) != B:
            raise ValueError(f"massive_positions has {len(mpos)} rows for {B} prompts")
        lengths = self.batch.lengths
        for b in range(B):
            for p in [ref[b], *mpos[b]]:
                if not 0 <= p < lengths[b]:
                    raise ValueError(f"position {p} is outside prompt {b} (length {lengths[b]})")
        _key_mask(self.batch, [[r] for r in ref])  # the reference needs a query after it
        to_each = {}
        for p in sorted({p for ps in mpos for p in ps}):
            has = torch.tensor([p in ps for ps in mpos])
            to_each[p] = self.to_key[..., p].masked_fill(~has[None, :, None], float("nan"))
        return AttentionProbe(
            to_ref=self.mass_on([[r] for r in ref]),
            to_each=to_each,
            bos=self.bos.clone(),
            entropy=self.entropy.clone(),
            reference=ref,
            massive_positions=mpos,
            eps=eps,
        )


class SinkRecorder:
    """Records ``out[l, b, h] = Σ_{p∈P_b} mean_{q>p} A_{l,b,h}[q, p]``: the attention mass every head
    puts on the reference positions ``P_b`` fixed before the forward, from the real queries that can
    see them (:func:`mean_to_keys`), chunk by chunk (``probes.batching``), so that it shares the
    forward pass of the norm scan; ``[layer batch head]`` only, where :class:`AttentionRecorder`
    keeps every key."""

    def __init__(
        self, model: LoadedModel, batch: Batch, positions: Sequence[Sequence[int]]
    ) -> None:
        B, T = batch.tokens.shape
        if len(positions) != B:
            raise ValueError(f"positions has {len(positions)} rows for {B} prompts")
        if min(batch.lengths) < 2:
            raise ValueError("attention statistics need prompts with at least 2 tokens")
        self.key_mask = torch.zeros(B, T)
        for b, ps in enumerate(positions):
            for p in ps:
                if not 0 <= p < batch.lengths[b]:
                    raise ValueError(
                        f"position {p} is outside prompt {b} (length {batch.lengths[b]})"
                    )
                self.key_mask[b, p] = 1.0
        self.model = model
        self.out = torch.zeros(model.n_layers, B, model.n_heads)

    def hooks(self, chunk: Chunk) -> list:
        dev = self.model.device
        key_mask = self.key_mask[chunk.rows, : chunk.width].to(dev)
        qmask = chunk.batch.attention_mask.bool().to(dev)
        rec = partial(self._record, rows=chunk.rows, key_mask=key_mask, qmask=qmask)
        return [(names.pattern(layer), partial(rec, layer=layer)) for layer in range(len(self.out))]

    def _record(self, pattern, hook, *, layer, rows, key_mask, qmask):
        per_key = mean_to_keys(pattern.detach().float(), qmask).nan_to_num(0.0)  # [n head k]
        self.out[layer, rows] = (per_key * key_mask[:, None, :]).sum(-1).cpu()  # [n head]
        return pattern

    def per_layer(self) -> list[float]:
        """Per layer: mean over prompts of the largest head's mass."""
        return self.out.amax(-1).mean(-1).tolist()  # [layer batch head] → [layer]


def _key_mask(batch: Batch, positions: Sequence[Sequence[int]]) -> torch.Tensor:
    B, T = batch.tokens.shape
    if len(positions) != B:
        raise ValueError(f"positions has {len(positions)} rows for {B} prompts")
    key_mask = torch.zeros(B, T)
    for b, ps in enumerate(positions):
        n = batch.lengths[b]
        for p in ps:
            if not 0 <= p < n:
                raise ValueError(f"position {p} is outside prompt {b} (length {n})")
            if p == n - 1:
                raise ValueError(
                    f"position {p} is the last token of prompt {b}: no query after it can attend "
                    "to it (the attention to a position is averaged over the queries q > p)"
                )
            key_mask[b, p] = 1.0
    return key_mask


def attention_stats(
    model: LoadedModel,
    batch: Prompts,
    positions: Sequence[Sequence[int]] | Sequence[int] | None = None,
    fwd_hooks: Sequence = (),
) -> AttentionStats:
    """Attention mass on ``positions`` (each from the queries after it) and attention entropy, per
    layer/prompt/head.

    Args:
        model: the :class:`~me_interp.models.LoadedModel`.
        batch: a prompt ``str``, a list of ``B`` prompts or a :class:`~me_interp.models.Batch`.
        positions: ``None`` for position 0; a list of ints applied to every prompt; or one list
            per prompt; none may be the last token of its prompt.
        fwd_hooks: interventions to run in the same forward.

    Returns:
        :class:`AttentionStats`: ``to_positions`` and ``entropy`` of shape ``[layer, batch, head]``.
    """
    batch = as_batch(model, batch)
    B = len(batch)
    if positions is None:
        per = [[0] for _ in range(B)]
    elif len(positions) > 0 and all(isinstance(p, int) for p in positions):
        per = [list(positions) for _ in range(B)]  # type: ignore[arg-type]
    else:
        per = [list(p) for p in positions]  # type: ignore[union-attr]
    _key_mask(batch, per)  # validate before the forward
    rec = AttentionRecorder(model, batch)
    record(model, batch, [rec], fwd_hooks=fwd_hooks)
    return AttentionStats(rec.mass_on(per), rec.entropy, per)


# ------------------------------------------------------------------------------------------
# attention to two given positions
# ------------------------------------------------------------------------------------------


def _attn_to(pattern, hook, *, store, layer, src, dst, qmask):
    a = pattern.detach().float()  # [batch head q k]
    qm = qmask.to(a.device, a.dtype)[:, None, :]  # [batch 1 q]
    n = qm.sum(-1)
    store[layer] = torch.stack(
        [(a[..., src] * qm).sum(-1) / n, (a[..., dst] * qm).sum(-1) / n]
    ).cpu()  # [2 batch head]: to src, to dst
    return pattern


def attention_src_dst(
    model: LoadedModel,
    batch: Batch,
    src: int,
    dst: int,
    layers: Sequence[int],
    fwd_hooks=(),
    ratio_layer: int | None = None,
    apart: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward: ``[layer, 2, batch, head]`` mean over the real queries ``q > max(src, dst)`` of
    ``A[q, src]`` and ``A[q, dst]``, and (with ``ratio_layer``) ``[2, batch]`` the norm ratios
    ``‖h_t‖ / mean_{t'≠t}‖h_t'‖`` of ``src`` and ``dst`` at the output of ``ratio_layer``; with
    ``apart`` the mean leaves out the other of the two as well (so that a massive ``dst`` does not
    make ``src`` look ordinary)."""
    q = batch.attention_mask.bool().clone()
    q[:, : max(src, dst) + 1] = False
    if not q.any(-1).all():
        raise ValueError(f"every prompt needs a token after position {max(src, dst)}")
    store: dict[int, torch.Tensor] = {}
    hooks = [
        (names.pattern(lay), partial(_attn_to, store=store, layer=lay, src=src, dst=dst, qmask=q))
        for lay in layers
    ]
    res = (
        None if ratio_layer is None else Activations(model, batch, [names.resid_post(ratio_layer)])
    )
    last = max([*layers, ratio_layer if ratio_layer is not None else 0])
    recs = [] if res is None else [res]
    record(model, batch, recs, fwd_hooks=[*fwd_hooks, *hooks], last_layer=last, max_tokens=None)
    # no layer: nothing to read attention from (the ME layer is the last layer)
    att = (
        torch.stack([store[lay] for lay in layers]) if layers else torch.zeros(0, 2, len(batch), 0)
    )
    ratios = None
    if ratio_layer is not None:
        norms = res[names.resid_post(ratio_layer)].float().norm(dim=-1).cpu()
        mask = batch.attention_mask.bool().cpu()
        masks = [mask.clone(), mask.clone()]
        if apart:
            masks[0][:, dst], masks[1][:, src] = False, False
        ratios = torch.stack(
            [
                ratio_to_others(norms, m, torch.full((len(batch),), t))
                for t, m in zip((src, dst), masks)
            ]
        )
    return att, ratios


# ------------------------------------------------------------------------------------------
# sink probe
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionProbe:
    """What :func:`attention_probe` measured (see module docstring). Layers are 0-based."""

    to_ref: Float[torch.Tensor, "layer batch head"]
    to_each: dict[int, Float[torch.Tensor, "layer batch head"]]
    bos: Float[torch.Tensor, "layer batch head"]
    entropy: Float[torch.Tensor, "layer batch head"]
    reference: list[int]
    massive_positions: list[list[int]]
    eps: float

    def sink_rate(self, eps: float | None = None) -> list[float]:
        return sink_rate(self.to_ref, self.eps if eps is None else eps).tolist()

    def head_sink_rate(self, eps: float | None = None) -> list[list[float]]:
        return head_sink_rate(self.to_ref, self.eps if eps is None else eps).tolist()

    def mean_to_ref(self) -> list[float]:
        return self.to_ref.mean((1, 2)).tolist()

    def head_to_ref(self) -> list[list[float]]:
        """``[layer][head]`` mean over prompts of the attention to the massive token."""
        return self.to_ref.mean(1).tolist()

    def mean_to_each(self) -> dict[int, list[float]]:
        """Per massive position: per layer, mean over the prompts where it is massive, and heads."""
        return {p: v.nanmean((1, 2)).tolist() for p, v in self.to_each.items()}

    def mean_bos(self) -> list[float]:
        return self.bos.mean((1, 2)).tolist()

    def mean_entropy(self) -> list[float]:
        return self.entropy.mean((1, 2)).tolist()

    def head_entropy(self) -> list[list[float]]:
        return self.entropy.mean(1).tolist()


def attention_probe(
    model: LoadedModel,
    batch: Prompts,
    reference: Sequence[int] | None = None,
    massive_positions: Sequence[Sequence[int]] | None = None,
    eps: float = 0.3,
    fwd_hooks: Sequence = (),
) -> AttentionProbe:
    """Attention to the massive token(s), sink rate, BOS metric and entropy per layer/prompt/head.

    One forward (in length-sorted chunks unless ``fwd_hooks`` are given).

    Args:
        model: the :class:`~me_interp.models.LoadedModel`.
        batch: a prompt ``str``, a list of prompts or a :class:`~me_interp.models.Batch`.
        reference: the massive token of each prompt (``None``: position 0); sink rate uses it.
        massive_positions: every massive position of each prompt (``None``: ``[reference]``).
        eps: sink threshold ε.
        fwd_hooks: interventions to run in the same forward.

    Raises:
        ValueError: a position outside its prompt, a reference that is its prompt's last token, a
            one-token prompt, or ``eps`` outside [0, 1).
    """
    batch = as_batch(model, batch)
    rec = AttentionRecorder(model, batch)
    rec.probe(reference, massive_positions, eps)  # validates the arguments before the forward
    record(model, batch, [rec], fwd_hooks=fwd_hooks)
    return rec.probe(reference, massive_positions, eps)


__all__ = [
    "AttentionProbe",
    "AttentionRecorder",
    "AttentionStats",
    "SinkRecorder",
    "attention_entropy",
    "attention_probe",
    "attention_src_dst",
    "attention_stats",
    "head_sink_rate",
    "mean_to_keys",
    "sink_rate",
]
