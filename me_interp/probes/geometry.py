"""Representation geometry of the token states of a layer: anisotropy and effective dimension.

For the real tokens of one prompt at one layer, ``H = [h_1 … h_n]ᵀ ∈ R^{n×d}`` (the layer output,
``resid_post``, *not* centred), with singular values ``s_1 ≥ … ≥ s_r``:

* mean pairwise cosine ``(2 / n(n−1)) Σ_{a<b} cos(h_a, h_b)`` (needs ``n ≥ 2``);
* effective rank (Roy & Vetterli 2007) ``exp(−Σ_i q_i log q_i)`` with ``q_i = s_i / Σ_j s_j``;
* participation ratio ``(Σ λ_i)² / Σ λ_i²`` with ``λ_i = s_i²`` (eigenvalues of ``HᵀH``).

An orthonormal set of ``n`` vectors has effective rank and participation ratio ``n`` and mean cosine 0;
``n`` copies of one direction have 1, 1 and 1. A massive token makes ``H`` close to rank one, so the
scan reports each metric over all real tokens and over the tokens other than the massive one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch
from jaxtyping import Float, Int

from me_interp import names
from me_interp.loading.inputs import Prompts, as_batch
from me_interp.models import Batch, LoadedModel
from me_interp.probes.alignment import reference_positions
from me_interp.probes.batching import Chunk, record

METRICS = ("mean_cos", "effective_rank", "participation_ratio")


def _check(x: torch.Tensor, need: int = 1) -> torch.Tensor:
    if x.shape[0] < need:
        raise ValueError(f"need at least {need} vectors, got {x.shape[0]}")
    return x.double()


def mean_pairwise_cosine(x: Float[torch.Tensor, "n d"]) -> float:
    """``mean_{a<b} cos(x_a, x_b)``.

    Raises:
        ValueError: fewer than 2 rows.
    """
    x = _check(x, 2)
    u = x / x.norm(dim=-1, keepdim=True)
    c = u @ u.T
    n = x.shape[0]
    iu = torch.triu_indices(n, n, 1)
    return float(c[iu[0], iu[1]].mean())


def singular_values(x: Float[torch.Tensor, "n d"]) -> Float[torch.Tensor, " r"]:
    return torch.linalg.svdvals(_check(x))


def effective_rank(x: Float[torch.Tensor, "n d"]) -> float:
    """``exp(−Σ q_i log q_i)``, ``q = s / Σ s`` over the singular values (``0 log 0 = 0``)."""
    s = singular_values(x)
    if not s.sum() > 0:
        raise ValueError("effective rank of an all-zero matrix is undefined")
    q = s / s.sum()
    q = q[q > 0]
    return float(torch.exp(-(q * q.log()).sum()))


def participation_ratio(x: Float[torch.Tensor, "n d"]) -> float:
    """``(Σ λ)² / Σ λ²`` with ``λ = s²``."""
    lam = singular_values(x) ** 2
    if not lam.sum() > 0:
        raise ValueError("participation ratio of an all-zero matrix is undefined")
    return float(lam.sum() ** 2 / (lam**2).sum())


def geometry_metrics(x: Float[torch.Tensor, "n d"]) -> dict[str, float]:
    """All of :data:`METRICS` for one set of vectors (mean cosine NaN for a single vector)."""
    return {
        "mean_cos": mean_pairwise_cosine(x) if x.shape[0] >= 2 else float("nan"),
        "effective_rank": effective_rank(x),
        "participation_ratio": participation_ratio(x),
    }


@dataclass(frozen=True)
class GeometryScan:
    """Per-layer, per-prompt geometry of the layer outputs. ``values[metric]["all"|"others"]``."""

    values: dict[str, dict[str, Float[torch.Tensor, "layer batch"]]]
    reference: Int[torch.Tensor, " batch"]

    def mean(self, metric: str, tokens: str = "all") -> list[float]:
        """Per layer, mean over prompts (NaN-aware)."""
        if metric not in self.values:
            raise ValueError(f"unknown metric {metric!r}; choose from {METRICS}")
        if tokens not in ("all", "others"):
            raise ValueError("tokens must be 'all' or 'others'")
        return self.values[metric][tokens].nanmean(-1).tolist()


def gram_metrics(g: Float[torch.Tensor, "n n"]) -> dict[str, float]:
    """:data:`METRICS` of the vectors whose Gram matrix ``G = H Hᵀ`` is ``g`` (float64): the singular
    values of ``H`` are ``sqrt(eig(G))``, the cosines ``G_ab / sqrt(G_aa G_bb)``.

    The same numbers as :func:`geometry_metrics` on ``H`` (to float64 rounding), from an ``n × n``
    eigenproblem instead of an ``n × d`` SVD, and leaving one vector out is deleting a row and a column.
    """
    g = g.double()
    n = g.shape[0]
    lam = torch.linalg.eigvalsh(g).clamp_min(0.0).flip(0)
    if not lam.sum() > 0:
        raise ValueError("effective rank of an all-zero matrix is undefined")
    sv = lam.sqrt()
    q = sv / sv.sum()
    q = q[q > 0]
    out = {
        "effective_rank": float(torch.exp(-(q * q.log()).sum())),
        "participation_ratio": float(lam.sum() ** 2 / (lam**2).sum()),
    }
    if n >= 2:
        d = g.diagonal().sqrt()
        c = g / (d[:, None] * d[None, :])
        iu = torch.triu_indices(n, n, 1)
        out["mean_cos"] = float(c[iu[0], iu[1]].mean())
    else:
        out["mean_cos"] = float("nan")
    return out


class GeometryRecorder:
    """Records :data:`METRICS` of every prompt's layer outputs, over all real tokens and without the
    token ``positions[b]``, at ``layers``, chunk by chunk (``probes.batching``)."""

    def __init__(
        self,
        model: LoadedModel,
        batch: Batch,
        positions: Sequence[int] | None = None,
        layers: Sequence[int] | None = None,
    ) -> None:
        self.model = model
        self.reference = reference_positions(batch, positions)
        L, B = model.n_layers, len(batch)
        self.layers = list(range(L)) if layers is None else [model.check_layer(x) for x in layers]
        self.values = {
            m: {t: torch.full((L, B), float("nan")) for t in ("all", "others")} for m in METRICS
        }

    def hooks(self, chunk: Chunk) -> list:
        return [
            (names.resid_post(layer), partial(self._record, layer=layer, chunk=chunk))
            for layer in self.layers
        ]

    def _record(self, x, hook, *, layer, chunk: Chunk):
        h = x.detach()
        for i, (b, n) in enumerate(zip(chunk.rows.tolist(), chunk.lengths)):
            rows = h[i, :n].double()
            g = rows @ rows.T  # [n n]
            keep = torch.ones(n, dtype=torch.bool, device=g.device)
            keep[int(self.reference[b])] = False
            for tokens, gram in (("all", g), ("others", g[keep][:, keep])):
                for m, v in gram_metrics(gram).items():
                    self.values[m][tokens][layer, b] = v
        return x

    def result(self) -> GeometryScan:
        return GeometryScan(values=self.values, reference=self.reference)


def geometry_scan(
    model: LoadedModel,
    batch: Prompts,
    positions: Sequence[int] | None = None,
    layers: Sequence[int] | None = None,
    fwd_hooks: Sequence = (),
) -> GeometryScan:
    """Mean pairwise cosine, effective rank and participation ratio of each prompt's token states.

    Computed in the ``resid_post`` hooks, one forward (in length-sorted chunks unless ``fwd_hooks``
    are given; no cache). ``"others"`` leaves out the massive token (``positions``, default 0).
    Layers not in ``layers`` stay NaN.

    Args:
        model: the :class:`~me_interp.models.LoadedModel`.
        batch: a prompt ``str``, a list of prompts or a :class:`~me_interp.models.Batch`.
        positions: the massive token of each prompt (``None``: position 0).
        layers: 0-based layers to measure (``None``: every layer).
        fwd_hooks: interventions to run in the same forward.
    """
    batch = as_batch(model, batch)
    rec = GeometryRecorder(model, batch, positions, layers)
    last = max(rec.layers) if rec.layers and not fwd_hooks else None
    record(model, batch, [rec], fwd_hooks=fwd_hooks, last_layer=last)
    return rec.result()


__all__ = [
    "METRICS",
    "GeometryRecorder",
    "GeometryScan",
    "effective_rank",
    "geometry_metrics",
    "geometry_scan",
    "gram_metrics",
    "mean_pairwise_cosine",
    "participation_ratio",
    "singular_values",
]
