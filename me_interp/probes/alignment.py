"""RMSNorm alignment: does the norm put the massive token's energy on the dims with large gain?

For a pre-norm RMSNorm with gain ``w ∈ R^d`` and output ``ĥ_t = h_t / rms(h_t) ⊙ w`` (paper.md §2, claim 2):

* ``WeightNorm_l(t) = ‖ĥ_t‖₂``;
* ``K = TopK(|w|, K)`` (the ``K`` dims of largest ``|w|``; ``K`` absolute, or a fraction of ``d``);
  ``Frac_t = Σ_{i∈K} ĥ_{t,i}² / Σ_i ĥ_{t,i}²``;
* energy distribution ``p_{t,i} = ĥ_{t,i}² / Σ_j ĥ_{t,j}²``, gain distribution ``g_i = w_i² / Σ_j w_j²``,
  ``KL(p_t‖g) = Σ_i p_{t,i} log(p_{t,i} / g_i)`` in nats (``0 log 0 = 0``; ``+inf`` if some ``p_i > 0``
  where ``g_i = 0``);
* ``ΔX = X_m − mean_{t≠m} X_t`` over the real tokens of a prompt, with ``m`` the massive token
  (position 0 by default, or the detected massive position of each prompt), then averaged over prompts.
  The paper expects ``ΔFrac > 0`` and ``ΔKL < 0`` at the ME layer.

The other tokens' statistics behind these deltas are :func:`delta_vs_others` and
:func:`mean_except_reference`; their mean *vector* ``h̄ = mean_{t∉P} h_t`` is :func:`others_mean`
(what the causal interventions write into a removed massive token).

Sites: ``"ffn_in"`` / ``"attn_in"`` are the pre-FFN / pre-attention RMSNorm outputs *after* the gain
(``blocks.L.ln2.hook_out`` / ``blocks.L.ln1.hook_out``): the paper's ``ĥ``. The *standardised* variant
``"ffn_normalized"`` / ``"attn_normalized"`` (``*.hook_normalized``, ``h / rms(h)`` before the gain) uses
the same ``K`` and ``g``; it tells whether the alignment is already in the residual stream or is made
by the gain. :func:`gain_ranks` reports where given dims (e.g. the massive dims) rank in ``|w|``, so a
massive dim with a *small* gain is shown plainly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from jaxtyping import Bool, Float, Int

from me_interp import claims, names
from me_interp.loading.inputs import Prompts, as_batch
from me_interp.models import Batch, LoadedModel
from me_interp.probes.batching import Chunk, record
from me_interp.selection import n_selected, top_abs_dims

NORMS = ("ffn", "attn")
ALIGN_SITES = ("ffn_in", "ffn_normalized", "attn_in", "attn_normalized")
_SITE_NORM = {
    "ffn_in": "ffn",
    "ffn_normalized": "ffn",
    "attn_in": "attn",
    "attn_normalized": "attn",
}


# ------------------------------------------------------------------------------------------
# tensor-level metrics
# ------------------------------------------------------------------------------------------


def resolve_k(k: int | float, d: int) -> int:
    """Number of top-gain dims: ``k`` itself if an int ≥ 1, ``max(1, floor(k·d + 0.5))`` if a float in
    (0, 1] (halves round up: the package's one count rule, ``selection.n_selected``).

    Raises:
        ValueError: ``k`` out of range.
    """
    if isinstance(k, bool):
        raise TypeError("k must be an int or a float, not a bool")
    if isinstance(k, int):
        if not 1 <= k <= d:
            raise ValueError(f"k={k} must be between 1 and d={d}")
        return k
    if isinstance(k, float):
        if not (0.0 < k <= 1.0) or math.isnan(k):
            raise ValueError(f"a fractional k must be in (0, 1], got {k}")
        return max(1, n_selected(k, d))
    raise TypeError(f"k must be an int or a float, got {type(k).__name__}")


def top_gain_dims(w: Float[torch.Tensor, " d"], k: int) -> Int[torch.Tensor, " k"]:
    """``TopK(|w|, k)``: indices of the ``k`` largest ``|w_i|`` (ties: lower index first)."""
    if not 1 <= k <= w.shape[0]:
        raise ValueError(f"k={k} must be between 1 and d={w.shape[0]}")
    return top_abs_dims(w, k)


def energy_distribution(h: Float[torch.Tensor, "*tok d"]) -> Float[torch.Tensor, "*tok d"]:
    """``p_i = h_i² / Σ_j h_j²`` along the last dim (NaN for an all-zero vector)."""
    e = h.float() ** 2
    return e / e.sum(-1, keepdim=True)


def gain_distribution(w: Float[torch.Tensor, " d"]) -> Float[torch.Tensor, " d"]:
    """``g_i = w_i² / Σ_j w_j²``.

    Raises:
        ValueError: if ``w`` is all zero.
    """
    e = w.detach().float() ** 2
    total = e.sum()
    if not total > 0:
        raise ValueError("the gain vector is all zero: its distribution is undefined")
    return e / total


def frac_on_dims(
    h: Float[torch.Tensor, "*tok d"], dims: Int[torch.Tensor, " k"]
) -> Float[torch.Tensor, "*tok"]:
    """``Frac = Σ_{i∈dims} h_i² / Σ_i h_i²`` along the last dim."""
    e = h.float() ** 2
    return e[..., dims].sum(-1) / e.sum(-1)


def kl_to_gain(
    p: Float[torch.Tensor, "*tok d"], g: Float[torch.Tensor, " d"]
) -> Float[torch.Tensor, "*tok"]:
    """``KL(p‖g) = Σ_i p_i log(p_i / g_i)`` in nats, with ``0 log 0 = 0`` (``+inf`` if ``p_i > 0 = g_i``)."""
    p = p.float()
    g = g.float().to(p.device)
    terms = torch.where(p > 0, p * (torch.log(p) - torch.log(g)), torch.zeros((), device=p.device))
    return terms.sum(-1)


def reference_positions(
    batch: Batch, positions: Sequence[int] | None = None
) -> Int[torch.Tensor, " batch"]:
    """The massive token of each prompt as a ``[batch]`` tensor (``None``: position 0 everywhere).

    Raises:
        ValueError: wrong number of positions, a position outside its prompt, or a prompt with a single
            token (a Δ needs other tokens).
    """
    lengths = batch.lengths
    if any(n < 2 for n in lengths):
        bad = next(i for i, n in enumerate(lengths) if n < 2)
        raise ValueError(
            f"prompt {bad} has a single token: Δ metrics compare the massive token with the other "
            "tokens of its prompt, so every prompt needs at least 2 tokens"
        )
    if positions is None:
        return torch.zeros(len(lengths), dtype=torch.long)
    pos = [int(p) for p in positions]
    if len(pos) != len(lengths):
        raise ValueError(f"got {len(pos)} massive positions for {len(lengths)} prompts")
    for b, (p, n) in enumerate(zip(pos, lengths)):
        if not 0 <= p < n:
            raise ValueError(f"massive position {p} is outside prompt {b} (length {n})")
    return torch.tensor(pos, dtype=torch.long)


def delta_vs_others(
    x: Float[torch.Tensor, "*lead batch pos"],
    mask: Bool[torch.Tensor, "batch pos"],
    ref: Int[torch.Tensor, " batch"],
) -> Float[torch.Tensor, "*lead batch"]:
    """``Δ = x[ref] − mean_{t≠ref, real} x[t]`` per prompt.

    Raises:
        ValueError: if a prompt has no other real token.
    """
    B = mask.shape[0]
    idx = torch.arange(B)
    mask = mask.to(x.device)
    ref = ref.to(x.device)
    others = mask.clone()
    others[idx, ref] = False
    n = others.sum(-1)
    if (n == 0).any():
        raise ValueError("a prompt has no token besides the massive one: Δ is undefined")
    other_mean = torch.where(others, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum(-1) / n
    return x[..., idx, ref] - other_mean


def mean_except_reference(
    x: Float[torch.Tensor, "*lead batch pos"],
    mask: Bool[torch.Tensor, "batch pos"],
    ref: Int[torch.Tensor, " batch"],
) -> Float[torch.Tensor, "*lead batch"]:
    """``mean_{t≠ref, real} x[t]`` per prompt: a per-token statistic averaged over the real tokens
    other than the reference one (not :func:`others_mean`, the mean residual *vector* of the
    tokens outside a position set)."""
    idx = torch.arange(mask.shape[0])
    return x[..., idx, ref] - delta_vs_others(x, mask, ref)


def others_mean(
    x: Float[torch.Tensor, "batch pos d"], mask: torch.Tensor, positions: Sequence[int]
) -> Float[torch.Tensor, "batch d"]:
    """``h̄ = mean_{t∉P} x_t`` over the real tokens of each prompt that are not in ``positions``
    (the fill of :func:`me_interp.interventions.causal.remove_massive`)."""
    keep = mask.bool().clone()
    keep[:, list(positions)] = False
    if not keep.any(-1).all():
        raise ValueError("every prompt needs at least one token outside the massive positions")
    w = keep.to(x.dtype)[..., None]
    return (x * w).sum(1) / w.sum(1)


@claims.of_means
def gain_alignment(m: np.ndarray) -> np.ndarray | float:
    """``min(1 − F_o / F_m, (E − E₀) / max(|E|, |E₀|))`` of rows ``(F_m, F_o, F_m⁰, F_o⁰)``: the
    massive token's share on the top-|w| dims after the gain, over the others' (``F``), and how
    much the gain widened its excess ``E = F_m − F_o`` over the standardised ``h / rms`` (``⁰``)."""
    fm, fo, fm0, fo0 = (m[..., i] for i in range(4))
    with np.errstate(divide="ignore", invalid="ignore"):
        excess = 1.0 - fo / fm
    e, e0 = fm - fo, fm0 - fo0
    top = np.maximum(np.abs(e), np.abs(e0))
    widened = claims.divide(e - e0, top, fill=0.0)
    return np.minimum(excess, widened)


@dataclass(frozen=True)
class GainRank:
    """Where one dim stands in ``|w|`` (rank 1 = the largest gain)."""

    dim: int
    abs_gain: float
    rank: int
    d: int
    ratio_to_median: float
    in_top_k: bool


def gain_ranks(w: Float[torch.Tensor, " d"], dims: Sequence[int], k: int) -> list[GainRank]:
    """Rank of each of ``dims`` in ``|w|``: ``rank = 1 + #{j : |w_j| > |w_i|}``; ``in_top_k = rank ≤ k``.

    Raises:
        ValueError: a dim outside ``[0, d)``.
    """
    a = w.detach().abs().float().cpu()
    d = a.shape[0]
    med = float(a.median())
    out = []
    for i in dims:
        if not 0 <= int(i) < d:
            raise ValueError(f"dim {i} is outside [0, {d})")
        rank = 1 + int((a > a[int(i)]).sum())
        out.append(
            GainRank(
                dim=int(i),
                abs_gain=float(a[int(i)]),
                rank=rank,
                d=d,
                ratio_to_median=float(a[int(i)]) / med if med > 0 else float("inf"),
                in_top_k=rank <= k,
            )
        )
    return out


# ------------------------------------------------------------------------------------------
# model-level scan
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SiteAlignment:
    """Per-token alignment statistics at one site of every layer."""

    weight_norm: Float[torch.Tensor, "layer batch pos"]
    frac: Float[torch.Tensor, "layer batch pos"]
    kl: Float[torch.Tensor, "layer batch pos"]


@dataclass(frozen=True)
class AlignmentScan:
    """What :func:`alignment_scan` measured (see module docstring). Layers are 0-based."""

    k: int
    sites: dict[str, SiteAlignment]
    mask: Bool[torch.Tensor, "batch pos"]
    reference: Int[torch.Tensor, " batch"]
    top_dims: dict[str, list[list[int]]]

    def _site(self, site: str) -> SiteAlignment:
        if site not in self.sites:
            raise ValueError(f"site {site!r} was not scanned; scanned: {sorted(self.sites)}")
        return self.sites[site]

    def delta_frac(self, site: str = "ffn_in") -> Float[torch.Tensor, "layer batch"]:
        """``ΔFrac`` per layer and prompt."""
        return delta_vs_others(self._site(site).frac, self.mask, self.reference)

    def delta_kl(self, site: str = "ffn_in") -> Float[torch.Tensor, "layer batch"]:
        """``ΔKL`` per layer and prompt."""
        return delta_vs_others(self._site(site).kl, self.mask, self.reference)

    def delta_weight_norm(self, site: str = "ffn_in") -> Float[torch.Tensor, "layer batch"]:
        return delta_vs_others(self._site(site).weight_norm, self.mask, self.reference)

    def massive(self, metric: str, site: str = "ffn_in") -> Float[torch.Tensor, "layer batch"]:
        """``metric`` (``frac``/``kl``/``weight_norm``) of the massive token per layer and prompt."""
        x = getattr(self._site(site), metric)
        return x[:, torch.arange(len(self.reference)), self.reference]

    def others(self, metric: str, site: str = "ffn_in") -> Float[torch.Tensor, "layer batch"]:
        """Mean of ``metric`` over the other real tokens, per layer and prompt."""
        return mean_except_reference(getattr(self._site(site), metric), self.mask, self.reference)

    def layer_means(self, layer: int) -> dict[str, float]:
        """The means over prompts (NaN-skipping) at ``layer``: ``delta_frac_<site>`` and
        ``delta_kl_<site>`` of every scanned site, ``<metric>_massive`` and ``<metric>_others``
        (``frac``, ``kl``, ``weight_norm``) at ``ffn_in``."""
        out = {}
        for s in self.sites:
            out[f"delta_frac_{s}"] = float(self.delta_frac(s)[layer].nanmean())
            out[f"delta_kl_{s}"] = float(self.delta_kl(s)[layer].nanmean())
        for m in ("frac", "kl", "weight_norm"):
            out[f"{m}_massive"] = float(self.massive(m, "ffn_in")[layer].nanmean())
            out[f"{m}_others"] = float(self.others(m, "ffn_in")[layer].nanmean())
        return out


class AlignmentRecorder:
    """Records ``WeightNorm``, ``Frac`` and ``KL(p‖g)`` of every token at ``sites`` of every layer,
    chunk by chunk (``probes.batching``); :meth:`result` gives the :class:`AlignmentScan`."""

    def __init__(
        self,
        model: LoadedModel,
        batch: Batch,
        k: int | float = 0.01,
        sites: Sequence[str] = ALIGN_SITES,
    ) -> None:
        for s in sites:
            if s not in ALIGN_SITES:
                raise ValueError(f"unknown alignment site {s!r}; choose from {ALIGN_SITES}")
        if not sites:
            raise ValueError("give at least one alignment site")
        self.model, self.batch, self.sites = model, batch, tuple(sites)
        self.k = resolve_k(k, model.d_model)
        L, (B, T) = model.n_layers, batch.tokens.shape
        self.store = {
            s: {m: torch.full((L, B, T), float("nan")) for m in ("weight_norm", "frac", "kl")}
            for s in sites
        }
        self.top: dict[str, list[list[int]]] = {s: [] for s in sites}
        self._consts = []
        for layer in range(L):
            gains = {"ffn": model.ffn_norm_gain(layer), "attn": model.attn_norm_gain(layer)}
            row = {}
            for s in sites:
                w = gains[_SITE_NORM[s]]
                dims = top_gain_dims(w, self.k)
                self.top[s].append(dims.tolist())
                row[s] = (dims.to(model.device), gain_distribution(w).to(model.device))
            self._consts.append(row)

    def hooks(self, chunk: Chunk) -> list:
        out = []
        for layer in range(self.model.n_layers):
            for s in self.sites:
                dims, g = self._consts[layer][s]
                fn = partial(self._record, layer=layer, site=s, dims=dims, g=g, chunk=chunk)
                out.append((names.site(s, layer), fn))
        return out

    def _record(self, x, hook, *, layer, site, dims, g, chunk: Chunk):
        h = x.detach().float()  # [n pos d]
        out, rows, w = self.store[site], chunk.rows, chunk.width
        out["weight_norm"][layer, rows, :w] = h.norm(dim=-1).cpu()
        out["frac"][layer, rows, :w] = frac_on_dims(h, dims).cpu()
        out["kl"][layer, rows, :w] = kl_to_gain(energy_distribution(h), g).cpu()
        return x

    def result(self, positions: Sequence[int] | None = None) -> AlignmentScan:
        """The scan, with ``positions`` the massive token of each prompt (``None``: position 0)."""
        ref = reference_positions(self.batch, positions)
        mask = self.batch.attention_mask.bool().cpu()
        result = {
            s: SiteAlignment(
                **{m: v.masked_fill(~mask, float("nan")) for m, v in self.store[s].items()}
            )
            for s in self.sites
        }
        return AlignmentScan(k=self.k, sites=result, mask=mask, reference=ref, top_dims=self.top)


def alignment_scan(
    model: LoadedModel,
    batch: Prompts,
    k: int | float = 0.01,
    positions: Sequence[int] | None = None,
    sites: Sequence[str] = ALIGN_SITES,
    fwd_hooks: Sequence = (),
) -> AlignmentScan:
    """Measure ``WeightNorm``, ``Frac`` and ``KL(p‖g)`` of every token at ``sites`` of every layer.

    One forward pass (in length-sorted chunks unless ``fwd_hooks`` are given); the statistics are
    computed inside the hooks (no activation cache).

    Args:
        model: the loaded model.
        batch: a prompt ``str``, a list of prompts or a :class:`~me_interp.models.Batch`.
        k: ``K`` of ``TopK(|w|, K)``: an int (absolute) or a float in (0, 1] (fraction of ``d``).
        positions: the massive token of each prompt (``None``: position 0).
        sites: any of :data:`ALIGN_SITES`.
        fwd_hooks: interventions to run in the same forward.

    Raises:
        ValueError: unknown site, bad ``k`` or bad positions.
    """
    batch = as_batch(model, batch)
    rec = AlignmentRecorder(model, batch, k, sites)
    reference_positions(batch, positions)  # validate before the forward
    record(model, batch, [rec], fwd_hooks=fwd_hooks)
    return rec.result(positions)


def massive_dim_gain_ranks(
    model: LoadedModel, dims: Sequence[int], k: int | float = 0.01
) -> dict[str, list[list[GainRank]]]:
    """For every layer, where ``dims`` rank in the pre-FFN and pre-attention gains ``|w|``."""
    kk = resolve_k(k, model.d_model)
    return {
        "ffn": [gain_ranks(model.ffn_norm_gain(L), dims, kk) for L in range(model.n_layers)],
        "attn": [gain_ranks(model.attn_norm_gain(L), dims, kk) for L in range(model.n_layers)],
    }


__all__ = [
    "ALIGN_SITES",
    "AlignmentRecorder",
    "AlignmentScan",
    "GainRank",
    "SiteAlignment",
    "alignment_scan",
    "delta_vs_others",
    "energy_distribution",
    "frac_on_dims",
    "gain_distribution",
    "gain_ranks",
    "kl_to_gain",
    "massive_dim_gain_ranks",
    "mean_except_reference",
    "others_mean",
    "reference_positions",
    "resolve_k",
    "top_gain_dims",
]
