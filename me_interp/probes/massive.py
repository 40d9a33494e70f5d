"""Massive-activation detection over all positions, and ME-layer localisation.

Detection, at each layer's output ``h_l`` (``resid_post``), per prompt and token (never only position 0):

* ``"sun"`` (Sun et al. 2024): some value ``|a| > abs_threshold`` (100) **and**
  ``|a| ≥ rel_threshold × median|a|`` (1000 ×, median over all real tokens and dims of that prompt's
  layer output);
* ``"norm"``: ``‖h_t‖ ≥ norm_ratio × median_{t'≠t} ‖h_{t'}‖``;
* ``"either"`` / ``"both"``: the union / intersection.

A layer *has* a massive activation when at least ``min_prompt_fraction`` of the prompts have a massive
token there. The *massive dims* of a massive token are those of its ``top_k`` largest values that pass
the value criterion (its top-1 dim when none does).

**ME layer (operational definition).** An *emergence event* is a maximal run of consecutive layers
whose outputs have a massive activation; it starts at layer ``l`` (0-based; ``l+1`` 1-based). Its *jump*
is the median over prompts of ``R_l / R_{l-1}`` with ``R = max_t ‖h_t‖ / mean_{t≠argmax} ‖h_t‖`` (the
embeddings stand in for ``R_{-1}``). Its *site* is the sub-layer that made most of the jump:
``log(R_mid/R_pre)`` (attention) against ``log(R_post/R_mid)`` (FFN), medians over prompts, the larger
one (the FFN on a tie). A sub-layer *makes* a jump only when it multiplies the norm ratio by at least
:data:`SITE_MIN_FACTOR` (2); when neither does, the site is ``"none"``: the ratio was already (about)
as large at the block input, e.g. a massive activation present in the embeddings, which starts an
event at layer 0 with a jump of about 1 (it is never credited to the FFN by the tie). The **ME layer**
is the start layer of the event with the largest jump. Every event is reported, including precursors
that vanish before the last layer.

**Scans without the block input or the attention output.** The site needs ``resid_pre`` and
``resid_mid``; without either, both gains are NaN and the site is ``"unknown"`` (never a guess). The
jump of an event at layer 0 needs ``resid_pre`` (the embeddings); without it the jump is NaN, and an
event with an unknown jump ranks below every event with a measured one (it is the ME layer only when
no event has a measured jump).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch
from jaxtyping import Bool, Float

from me_interp.probes.norms import NormScan, ratio_to_others, top_ratio

if TYPE_CHECKING:
    from me_interp.loading.inputs import Prompts
    from me_interp.loading.loaded import LoadedModel

CriterionKind = Literal["sun", "norm", "either", "both"]
Site = Literal["attention", "ffn", "none", "unknown"]

SITE_MIN_FACTOR = 2.0
"""The factor by which a sub-layer must multiply the median norm ratio to be an event's site; an
event whose attention and FFN both stay below it has site ``"none"``."""


def site_text(site: str) -> str:
    """What made an event, in words: ``"the ffn"``, ``"the attention"``, ``"no sub-layer (already
    massive at the block input)"`` or ``"an unknown sub-layer (no block input or attention output
    recorded)"``."""
    return {
        "none": "no sub-layer (already massive at the block input)",
        "unknown": "an unknown sub-layer (no block input or attention output recorded)",
    }.get(site, f"the {site}")


@dataclass(frozen=True)
class Criterion:
    """Massive-activation criterion (see module docstring)."""

    kind: str = "sun"  # one of CriterionKind; validated in __post_init__
    abs_threshold: float = 100.0
    rel_threshold: float = 1000.0
    norm_ratio: float = 50.0
    min_prompt_fraction: float = 0.5

    def __post_init__(self) -> None:
        if self.kind not in ("sun", "norm", "either", "both"):
            raise ValueError(f"criterion kind must be sun/norm/either/both, got {self.kind!r}")
        if not self.abs_threshold >= 0:
            raise ValueError(f"abs_threshold must be >= 0, got {self.abs_threshold}")
        for f in ("rel_threshold", "norm_ratio"):  # ratios to a median: below 1 every token passes
            if not getattr(self, f) >= 1:
                raise ValueError(
                    f"{f} must be >= 1 (a ratio to the median), got {getattr(self, f)}"
                )
        if not 0 < self.min_prompt_fraction <= 1:
            raise ValueError("min_prompt_fraction must be in (0, 1]")


def value_passes(scan: NormScan, crit: Criterion) -> Bool[torch.Tensor, "layer batch pos k"]:
    """Which of each token's top-k values pass the value (Sun) criterion."""
    med = scan.median_abs[:, :, None, None]
    return (scan.top_abs > crit.abs_threshold) & (scan.top_abs >= crit.rel_threshold * med)


def others_median(
    x: Float[torch.Tensor, "layer batch pos"], mask: Bool[torch.Tensor, "batch pos"]
) -> Float[torch.Tensor, "layer batch pos"]:
    """Per token, the median of ``x`` over the *other* real tokens of its prompt (the lower median
    for an even count, as ``torch.median``; NaN for a prompt with a single token).

    One sort per prompt: with the real values sorted, ``s_0 ≤ … ≤ s_{n−1}``, removing the token of rank
    ``r`` leaves ``n − 1`` values whose lower median (index ``k = ⌊(n − 2) / 2⌋``) is ``s_k`` if
    ``k < r``, else ``s_{k+1}``.
    """
    m = mask.to(x.device)[None].expand_as(x)
    vals, order = torch.sort(torch.where(m, x, torch.full((), float("inf"))), dim=-1)
    rank = torch.argsort(order, dim=-1)
    n = m.sum(-1, keepdim=True)  # [layer batch 1]
    k = ((n - 2).clamp(min=0) // 2).long()
    s_k = vals.gather(-1, k)
    s_k1 = vals.gather(-1, (k + 1).clamp(max=x.shape[-1] - 1))
    med = torch.where(rank > k, s_k, s_k1)
    return med.masked_fill(n < 2, float("nan"))


def massive_tokens(scan: NormScan, crit: Criterion) -> Bool[torch.Tensor, "layer batch pos"]:
    """Which (layer, prompt, position) are massive under ``crit``."""
    sun = value_passes(scan, crit).any(-1)
    norms = scan.site_norms("resid_post")  # [layer batch pos]
    mask = scan.mask
    by_norm = norms >= crit.norm_ratio * others_median(norms, mask)  # NaN compares False
    combined = {
        "sun": sun,
        "norm": by_norm,
        "either": sun | by_norm,
        "both": sun & by_norm,
    }[crit.kind]
    return combined & mask


@dataclass(frozen=True)
class Event:
    """One emergence event (0-based layers; ``None`` end means it lasts to the last layer)."""

    layer: int
    layer_1based: int
    last_layer: int
    persists_to_end: bool
    jump: float
    site: Site
    attn_log_gain: float
    ffn_log_gain: float
    positions: list[list[int]]
    dims: list[int]
    prompt_fraction: float

    def cells(self) -> tuple:
        """The summary-table cells (:data:`EVENT_COLUMNS`)."""
        end = "yes" if self.persists_to_end else "no"
        first = (self.layer, self.layer_1based, self.last_layer, end)
        return (*first, self.site, self.jump, str(self.dims[:4]))


EVENT_COLUMNS = ("start", "start(1b)", "last", "to end", "site", "jump", "dims")
"""The columns of :meth:`Event.cells`."""


@dataclass(frozen=True)
class MELocation:
    """Where massive activations are born: the ME layer, every event, per-layer statistics."""

    criterion: Criterion
    me_layer: int | None
    events: list[Event]
    layer_has_massive: list[bool]
    prompt_fraction: list[float]
    top_ratio: list[float]
    max_over_median: list[float]
    massive_positions: list[list[int]]
    massive_dims: list[int]
    reference_positions: list[int]
    site_ratios: dict[str, list[float]] = field(default_factory=dict)

    @property
    def me_layer_1based(self) -> int | None:
        return None if self.me_layer is None else self.me_layer + 1

    @property
    def me_event(self) -> Event | None:
        return next((e for e in self.events if e.layer == self.me_layer), None)

    def __repr__(self) -> str:  # the headline numbers, not the per-layer lists
        n = len(self.layer_has_massive)
        if self.me_layer is None:
            return f"MELocation(me_layer=None: no massive activation in {n} layers)"
        e, pos = self.me_event, sorted({p for row in self.massive_positions for p in row})
        made = f", made by {site_text(e.site)}, ratio jump x{e.jump:.3g}" if e else ""
        shown = pos[:8] + (["..."] if len(pos) > 8 else [])  # type: ignore[list-item]
        return (
            f"MELocation(me_layer={self.me_layer} (1-based {self.me_layer_1based}) of {n}{made}; "
            f"{len(self.events)} event(s); dims {self.massive_dims[:8]}; positions "
            f"{', '.join(map(str, shown))}; top ratio {self.top_ratio[self.me_layer]:.4g})"
        )


def _dims_at(scan: NormScan, crit: Criterion, massive: torch.Tensor, layer: int) -> list[int]:
    passes = value_passes(scan, crit)[layer]  # [batch pos k]
    counts: dict[int, int] = {}
    for b, t in torch.nonzero(massive[layer]).tolist():
        dims = scan.top_dims[layer, b, t][passes[b, t]].tolist() or [
            int(scan.top_dims[layer, b, t, 0])
        ]
        for d in dims:
            counts[d] = counts.get(d, 0) + 1
    return sorted(counts, key=lambda d: (-counts[d], d))


def _positions_at(massive: torch.Tensor, layer: int) -> list[list[int]]:
    return [torch.nonzero(row).flatten().tolist() for row in massive[layer]]


def _median(x: torch.Tensor) -> float:
    return float(x.float().nanmedian())


def _medians(x: torch.Tensor) -> list[float]:
    """:func:`_median` of each row of ``x [rows n]``, in one call."""
    return x.float().nanmedian(dim=-1).values.tolist()


def _reference(
    massive: Bool[torch.Tensor, "layer batch pos"],
    norms: torch.Tensor,
    layer: int,
) -> torch.Tensor:
    """Per prompt, the largest-norm massive token of ``layer`` (position 0 where none)."""
    ref_norm = torch.where(massive[layer], norms[layer], torch.full((), -1.0))
    has_ref = massive[layer].any(-1)
    return torch.where(has_ref, ref_norm.argmax(-1), torch.zeros_like(has_ref, dtype=torch.long))


def _site(attn_gain: float, ffn_gain: float) -> Site:
    """The sub-layer with the larger log gain (the FFN on a tie); ``"none"`` when neither gain
    reaches ``log(SITE_MIN_FACTOR)``; ``"unknown"`` when a gain is NaN."""
    if math.isnan(attn_gain) or math.isnan(ffn_gain):
        return "unknown"
    if max(attn_gain, ffn_gain) < math.log(SITE_MIN_FACTOR):
        return "none"
    return "attention" if attn_gain > ffn_gain else "ffn"


def _rank_of(jump: float, layer: int) -> tuple[bool, float, int]:
    """ME-layer order of an event at ``layer`` with ``jump``: a measured jump beats an unknown (NaN)
    one; then the larger jump; then the earlier layer."""
    known = not math.isnan(jump)
    return known, jump if known else 0.0, -layer


def _rank(e: Event) -> tuple[bool, float, int]:
    return _rank_of(e.jump, e.layer)


def _runs(has: Sequence[bool]) -> list[tuple[int, int]]:
    """``(first, last)`` layer of each run of consecutive layers that have the massive activation:
    the emergence events."""
    runs: list[tuple[int, int]] = []
    for layer, h in enumerate(has):
        if not h:
            continue
        if runs and runs[-1][1] == layer - 1:
            runs[-1] = (runs[-1][0], layer)
        else:
            runs.append((layer, layer))
    return runs


def prompt_me_layers(scan: NormScan, crit: Criterion | None = None) -> list[int | None]:
    """Per prompt, the ME layer :func:`locate_me_layer` finds on that prompt's scan rows alone, for
    every prompt at once: on one prompt a layer "has" the massive activation when the prompt has a
    massive token there, an event is a run of such layers, its jump the prompt's ratio ``R`` across
    the run's first layer, and the ME layer the event of the largest known jump (the earliest on a
    tie), as :func:`locate_me_layer` ranks them."""
    crit = crit or Criterion()
    has = massive_tokens(scan, crit).any(-1)  # [layer batch]
    r_post = top_ratio(scan.site_norms("resid_post"), scan.mask)  # [layer batch]
    r_pre = (
        top_ratio(scan.site_norms("resid_pre"), scan.mask) if "resid_pre" in scan.sites else None
    )
    out: list[int | None] = []
    for b in range(scan.mask.shape[0]):
        best: tuple[tuple[bool, float, int], int] | None = None
        for start, _ in _runs(has[:, b].tolist()):
            before = r_post[start - 1, b] if start > 0 else (None if r_pre is None else r_pre[0, b])
            jump = math.nan if before is None else float((r_post[start, b] / before).float())
            rank = _rank_of(jump, start)
            if best is None or rank > best[0]:
                best = (rank, start)
        out.append(None if best is None else best[1])
    return out


def massive_reference(scan: NormScan, crit: Criterion | None, layer: int) -> list[int]:
    """The *reference* massive token of each prompt at ``layer``: its largest-norm massive token
    there, position 0 where it has none (as :attr:`MELocation.reference_positions` at the ME layer).

    Raises:
        ValueError: ``layer`` out of range.
    """
    if not 0 <= layer < scan.n_layers:
        raise ValueError(f"layer {layer} out of range for {scan.n_layers} layers")
    massive = massive_tokens(scan, crit or Criterion())
    return _reference(massive, scan.site_norms("resid_post"), layer).tolist()


def locate_me_layer(scan: NormScan, crit: Criterion | None = None) -> MELocation:
    """Find every emergence event and the ME layer from a :class:`NormScan` (see module docstring).

    Raises:
        ValueError: if a prompt has a single token (the ratios need other tokens).
    """
    crit = crit or Criterion()
    mask = scan.mask
    if (mask.sum(-1) < 2).any():
        bad = int(torch.nonzero(mask.sum(-1) < 2)[0, 0])
        raise ValueError(
            f"prompt {bad} has a single token: the ME-layer scan compares each token with the other "
            "tokens of its prompt, so every prompt needs at least 2 tokens"
        )
    n_layers = scan.n_layers
    massive = massive_tokens(scan, crit)  # [layer batch pos]
    frac = massive.any(-1).float().mean(-1)  # [layer]
    has = [bool(f >= crit.min_prompt_fraction) for f in frac]

    r_post = top_ratio(scan.site_norms("resid_post"), mask)  # [layer batch]
    r_pre = top_ratio(scan.site_norms("resid_pre"), mask) if "resid_pre" in scan.sites else None
    r_mid = top_ratio(scan.site_norms("resid_mid"), mask) if "resid_mid" in scan.sites else None

    events: list[Event] = []
    for start, layer in _runs(has):
        before = r_post[start - 1] if start > 0 else (r_pre[0] if r_pre is not None else None)
        jump = _median(r_post[start] / before) if before is not None else math.nan
        if r_pre is not None and r_mid is not None:
            attn_gain = _median(torch.log(r_mid[start] / r_pre[start]))
            ffn_gain = _median(torch.log(r_post[start] / r_mid[start]))
        else:
            attn_gain = ffn_gain = math.nan
        events.append(
            Event(
                layer=start,
                layer_1based=start + 1,
                last_layer=layer,
                persists_to_end=layer == n_layers - 1,
                jump=jump,
                site=_site(attn_gain, ffn_gain),
                attn_log_gain=attn_gain,
                ffn_log_gain=ffn_gain,
                positions=_positions_at(massive, start),
                dims=_dims_at(scan, crit, massive, start),
                prompt_fraction=float(frac[start]),
            )
        )

    me_event = max(events, key=_rank) if events else None
    me_layer = None if me_event is None else me_event.layer
    if me_layer is not None:
        reference = _reference(massive, scan.site_norms("resid_post"), me_layer)
    else:
        reference = torch.zeros(mask.shape[0], dtype=torch.long)
    site_ratios = {
        s: _medians(ratio_to_others(scan.site_norms(s), mask, reference)) for s in scan.sites
    }
    max_abs = scan.top_abs[..., 0].masked_fill(~mask, 0).amax(-1)  # [layer batch]
    return MELocation(
        criterion=crit,
        me_layer=me_layer,
        events=events,
        layer_has_massive=has,
        prompt_fraction=frac.tolist(),
        top_ratio=_medians(r_post),
        max_over_median=_medians(max_abs / scan.median_abs),
        massive_positions=_positions_at(massive, me_layer) if me_layer is not None else [],
        massive_dims=_dims_at(scan, crit, massive, me_layer) if me_layer is not None else [],
        reference_positions=reference.tolist(),
        site_ratios=site_ratios,
    )


def find_me_layer(
    model: LoadedModel, batch: Prompts, criterion: Criterion | None = None, fwd_hooks=()
) -> MELocation:
    """Scan ``batch`` (with optional intervention hooks) and localise the ME layer in one call.

    Args:
        model: the :class:`~me_interp.models.LoadedModel`.
        batch: a prompt ``str``, a list of prompts or a :class:`~me_interp.models.Batch`.
        criterion: the massive-activation criterion (default: :class:`Criterion`'s).
        fwd_hooks: ``[(hook_name, fn), ...]`` interventions to run in the same forward.

    Returns:
        :class:`MELocation`: ``me_layer`` (0-based, ``None`` when none), every :class:`Event`,
        per-layer statistics (lists of length ``n_layers``), the massive positions and dims.
    """
    from me_interp import names
    from me_interp.loading.inputs import as_batch
    from me_interp.probes.norms import scan_norms

    batch = as_batch(model, batch)
    return locate_me_layer(
        scan_norms(model, batch, names.SITES, extra_hooks=list(fwd_hooks)), criterion
    )
