"""Every massive token of a batch, at every position: where it is born, how long it lives, what it
shares with the first token, and the attention it draws.

:func:`scan_positions` runs the batch once (``probes.batching.record``; a left-padded batch is read
right-aligned, so positions count from each row's first real token) with three recorders: the norm
scan of the Site (:class:`~me_interp.probes.norms.NormRecorder`), the layer outputs of each row's
``k`` largest-norm tokens and of its first token (:class:`StateRecorder`), and every key's attention
from the real queries after it (:class:`KeyAttentionRecorder`, ``mean_{q>k} A[q, k]``). With the
Site's one detection rule (:func:`~me_interp.probes.massive.massive_tokens`) a token ``(b, t)`` is
massive at layer ``l``; for every token massive at some layer it gives (:class:`MassiveToken`):

* ``birth`` / ``last``: the first layer it is massive and the last of that run of layers;
  ``eraser``: the sub-layer of layer ``last + 1`` that shrinks its norm more (``log ‖h_mid‖/‖h_pre‖``
  for the attention against ``log ‖h_post‖/‖h_mid‖`` for the FFN; ``""`` when it lives to the end);
* ``dims``: its massive dims at ``birth`` (the top values that pass the value criterion, else the
  top-1) and ``overlap``: the fraction of them among the first token's (at its birth; the Site's
  massive dims where the first token is not massive);
* ``cosine``: ``cos(h_{l,b,t}, h_{l,b,0})`` at the later of the two births (the Site's layer where
  the first token is not massive; NaN where ``t`` is not among the row's ``k`` largest norms there);
* ``sink``: the largest head's mean attention to it from the queries after it, over the layers
  after ``birth`` (NaN for a last token).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
from jaxtyping import Bool, Float

from me_interp import names
from me_interp.loading.loaded import Batch, LoadedModel
from me_interp.probes.batching import Chunk, record
from me_interp.probes.massive import Criterion, massive_tokens, value_passes
from me_interp.probes.norms import NormRecorder, NormScan
from me_interp.probes.site import SCAN_SITES, Site, locate


class StateRecorder:
    """Per layer and row, the layer outputs of the ``k`` largest-norm real tokens (``idx``, ``vecs``)
    and of the first token (``first``), fp32 on the CPU."""

    def __init__(self, model: LoadedModel, batch: Batch, k: int = 16) -> None:
        B, T = batch.tokens.shape
        L, d = model.n_layers, model.d_model
        self.k = min(k, T)
        self.idx = torch.full((L, B, self.k), -1, dtype=torch.long)
        self.vecs = torch.zeros(L, B, self.k, d)
        self.first = torch.zeros(L, B, d)

    def hooks(self, chunk: Chunk) -> list:
        mask = chunk.batch.attention_mask.bool()
        rec = partial(self._record, rows=chunk.rows, mask=mask)
        return [(names.resid_post(L), partial(rec, layer=L)) for L in range(len(self.idx))]

    def _record(self, x, hook, *, layer, rows, mask):
        h = x.detach().float()
        k = min(self.k, h.shape[1])
        norm = torch.linalg.vector_norm(h, dim=-1).masked_fill(~mask.to(h.device), -1.0)
        top = norm.topk(k, dim=-1).indices  # [n k]
        self.idx[layer, rows, :k] = top.cpu()
        self.vecs[layer, rows, :k] = h.gather(1, top[..., None].expand(-1, -1, h.shape[-1])).cpu()
        self.first[layer, rows] = h[:, 0].cpu()
        return x

    def state(self, layer: int, row: int, pos: int) -> torch.Tensor | None:
        """The layer output of token ``pos`` of ``row`` at ``layer``, if it was kept."""
        if pos == 0:
            return self.first[layer, row]
        hit = (self.idx[layer, row] == pos).nonzero().flatten()
        return self.vecs[layer, row, int(hit[0])] if len(hit) else None


class KeyAttentionRecorder:
    """``out[l, b, h, k] = mean_{q>k, q real} A_{l,b,h}[q, k]`` for every key (NaN where no real
    query follows it): ``[layer batch head key]``, never a whole pattern.

    Causal attention is zero above the diagonal, so the sum over the real queries after ``k`` is one
    matrix-vector product over the pattern less its diagonal, ``Σ_q m_q A[q, k] − m_k A[k, k]``
    (``m``: the real-query mask), divided by ``Σ_{q>k} m_q`` (one pass over the pattern, where
    :func:`~me_interp.probes.attention.mean_to_keys` reads it through a ``[batch q k]`` mask)."""

    def __init__(self, model: LoadedModel, batch: Batch) -> None:
        B, T = batch.tokens.shape
        self.out = torch.full((model.n_layers, B, model.n_heads, T), float("nan"))

    def hooks(self, chunk: Chunk) -> list:
        qmask = chunk.batch.attention_mask.bool()
        rec = partial(self._record, rows=chunk.rows, qmask=qmask)
        return [(names.pattern(L), partial(rec, layer=L)) for L in range(len(self.out))]

    def _record(self, pattern, hook, *, layer, rows, qmask):
        self.out[layer, rows, :, : pattern.shape[-1]] = key_means(pattern.detach(), qmask).cpu()
        return pattern


def key_means(
    pattern: Float[torch.Tensor, "batch head query_pos key_pos"],
    query_mask: Bool[torch.Tensor, "batch query_pos"],
) -> Float[torch.Tensor, "batch head key_pos"]:
    """``mean_{q>k, q real} A[q, k]`` of a causal pattern (zero above the diagonal), for every key
    (NaN where no real query follows ``k``), in fp32 (see :class:`KeyAttentionRecorder`)."""
    m = query_mask.to(pattern.device, torch.float32)  # [batch q]
    a = pattern.float()
    total = (m[:, None, None, :] @ a).squeeze(-2)  # [batch head k]: Σ_q m_q A[q, k]
    total = total - a.diagonal(dim1=-2, dim2=-1) * m[:, None, :]
    after = (m.flip(-1).cumsum(-1).flip(-1) - m)[:, None, :]  # Σ_{q>k} m_q
    return torch.where(after > 0, total / after.clamp_min(1.0), float("nan"))


@dataclass(frozen=True)
class MassiveToken:
    """One massive token (see the module docstring; 0-based layers, position from the row's first
    real token)."""

    row: int
    position: int
    token: int
    text: str
    birth: int
    last: int
    eraser: str
    dims: tuple[int, ...]
    overlap: float
    cosine: float
    sink: float


@dataclass(frozen=True)
class PositionScan:
    """What :func:`scan_positions` measured on one batch."""

    site: Site
    scan: NormScan
    tokens: list[MassiveToken]
    states: StateRecorder
    ids: torch.Tensor  # [batch pos], right-aligned

    def ratios(self, row: int) -> Float[torch.Tensor, "layer pos"]:
        """``‖h_{l,t}‖ / median_t' ‖h_{l,t'}‖`` of ``row``'s real tokens at every layer output."""
        n = int(self.scan.mask[row].sum())
        norms = self.scan.site_norms("resid_post")[:, row, :n]
        return norms / norms.median(-1, keepdim=True).values


@dataclass(frozen=True)
class Condition:
    """The massive tokens of one set of rows, one condition of the inputs (the conditions
    experiment; positions from each row's first real token), from a :class:`PositionScan`.

    Attributes:
        name: the condition (``long`` is ``long_<n>``); note: why it was skipped, or a remark.
        n_rows: its rows; layer: the Site's layer on them (``None``: no massive activation).
        positions: per row, the massive positions at that layer; units: the distinct prefixes.
        tokens: every massive token at any layer (:class:`MassiveToken`); ratios: row 0's norm
            over the median norm, per layer and position (the figure), after its ``pads``.
    """

    name: str
    note: str
    n_rows: int
    layer: int | None
    positions: list[list[int]]
    units: list[list[int]]
    tokens: list[MassiveToken]
    ratios: list[list[float]]
    pads: int = 0

    @classmethod
    def of(cls, name: str, note: str, scan: PositionScan, rows: list[list[int]], left: bool):
        """``scan`` of ``rows`` (``left``: padded on the left) as condition ``name``."""
        pads, site = max(map(len, rows)) - len(rows[0]) if left else 0, scan.site
        positions, units = [list(p) for p in site.positions], [list(g) for g in site.units.groups]
        ratios = scan.ratios(0).tolist()
        return cls(name, note, len(rows), site.layer, positions, units, scan.tokens, ratios, pads)


def state_differences(scan: PositionScan, other: PositionScan) -> list[float]:
    """Per row, ``‖h' − h‖ / ‖h‖`` of its massive token's state at ``scan``'s Site layer, ``h`` in
    ``scan`` and ``h'`` in ``other`` (the same rows, e.g. left-padded); rows whose state was not kept
    are left out, and no Site layer gives ``[]``."""
    site = scan.site
    if site.layer is None:
        return []
    out = []
    for b, r in enumerate(site.reference):
        h, h2 = scan.states.state(site.layer, b, r), other.states.state(site.layer, b, r)
        if h is not None and h2 is not None:
            out.append(float((h2 - h).norm() / h.norm()))
    return out


def _eraser(scan: NormScan, layer: int, b: int, t: int) -> str:
    pre, mid, post = (scan.site_norms(s)[layer, b, t] for s in SCAN_SITES)
    attn, ffn = math.log(float(mid / pre)), math.log(float(post / mid))
    return "attention" if attn < ffn else "ffn"


def scan_positions(
    model: LoadedModel, batch: Batch, criterion: Criterion | None = None, k: int = 16
) -> PositionScan:
    """Every massive token of ``batch`` at every position (see the module docstring)."""
    crit = criterion or Criterion()
    norm = NormRecorder(model, batch, SCAN_SITES)
    states, keys = StateRecorder(model, batch, k), KeyAttentionRecorder(model, batch)
    record(model, batch, [norm, states, keys])
    scan = norm.result()
    site = locate(model, batch, scan=scan, criterion=crit)
    massive = massive_tokens(scan, crit)  # [layer batch pos]
    passes = value_passes(scan, crit)
    ids = batch.right_aligned().tokens.cpu()
    L = scan.n_layers
    first = {}  # row -> (birth, dims) of its first token, where it is massive
    out = []
    for b, t in torch.nonzero(massive.any(0)).tolist():  # row-major: each row's token 0 first
        layers = torch.nonzero(massive[:, b, t]).flatten().tolist()
        birth = last = layers[0]
        while last + 1 < L and bool(massive[last + 1, b, t]):
            last += 1
        dims = scan.top_dims[birth, b, t][passes[birth, b, t]].tolist() or [
            int(scan.top_dims[birth, b, t, 0])
        ]
        if t == 0:
            first[b] = (birth, set(dims))
        born0, dims0 = first.get(b, (None, set(site.dims)))
        at = max(birth, born0) if born0 is not None else birth if site.layer is None else site.layer
        h, h0 = states.state(at, b, t), states.state(at, b, 0)
        cos = float("nan") if h is None else float(torch.cosine_similarity(h, h0, dim=0))
        after = keys.out[birth + 1 :, b, :, t]  # [layer head]
        sink = float(after.nan_to_num(-1.0).amax()) if after.numel() else float("nan")
        out.append(
            MassiveToken(
                row=b,
                position=t,
                token=int(ids[b, t]),
                text=model.tokenizer.decode([int(ids[b, t])]),
                birth=birth,
                last=last,
                eraser="" if last == L - 1 else _eraser(scan, last + 1, b, t),
                dims=tuple(int(d) for d in dims),
                overlap=len(set(dims) & dims0) / len(dims),
                cosine=cos,
                sink=float("nan") if sink < 0 else sink,
            )
        )
    return PositionScan(site, scan, out, states, ids)


__all__ = [
    "Condition",
    "KeyAttentionRecorder",
    "MassiveToken",
    "PositionScan",
    "StateRecorder",
    "key_means",
    "scan_positions",
    "state_differences",
]
