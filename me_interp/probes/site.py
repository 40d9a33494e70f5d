"""The Site: where the massive activation is, located once, the one way every experiment does it.

:func:`locate` runs the ME-layer probe (:func:`me_interp.probes.massive.locate_me_layer` on a norm
scan, the experiment's own or a fresh one) and answers, for one batch of prompts:

* ``layer`` — the layer to study: the given one, else the detected ME layer;
* ``reference`` / ``positions`` — per prompt, its massive token (the largest-norm massive token at
  ``layer``, position 0 where none; or a given position) and every massive position at ``layer``;
* ``dims`` — the massive dims at ``layer`` (the probe's, commonest first; at a layer without a
  massive token, the largest ``|a|`` of the massive token, commonest over prompts);
* ``units`` — the prompts grouped by their massive token's prefix ``x[: m + 1]``: with causal
  attention the massive token's state is one measurement per distinct prefix, so ``units.n`` is the
  effective n of every statistic of that state, and the seeded halves are what held-out claims select
  and test on;
* ``why_not`` — the one "not applicable" reason (no massive activation and no layer given; or none
  at the given layer), worded in one place (:func:`no_massive_why`).

Positions are counted from each row's first real token: on a left-padded batch (as batched inference
pads, read from its attention mask) position 0 is the first real token, never a pad
(``probes.batching.record`` hands the probes every row right-aligned).

Experiments, WeMask, the viewer and the survey use it; nothing else locates the massive activation.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from me_interp import claims
from me_interp.loading.inputs import Prompts, as_batch
from me_interp.loading.loaded import LoadedModel
from me_interp.probes.massive import (
    Criterion,
    MELocation,
    locate_me_layer,
    massive_reference,
    massive_tokens,
)
from me_interp.probes.norms import NormScan, scan_norms

NO_MASSIVE = "no massive activation on this model"


def no_massive_why(loc: MELocation, n_prompts: int, hint: str = "") -> str:
    """Why the claims about a massive activation are not applicable on a model without one (the one
    wording): the criterion in words, the prompt fraction it needs, and ``hint`` (what to pass to
    measure a layer anyway)."""
    c = loc.criterion
    rule = {
        "sun": f"some |a| > {c.abs_threshold:g} and ≥ {c.rel_threshold:g} × the median |a|",
        "norm": f"a token norm ≥ {c.norm_ratio:g} × the median of the others",
        "either": "the value or the norm criterion",
        "both": "the value and the norm criterion",
    }[c.kind]
    return (
        f"{NO_MASSIVE}: no layer output has a massive token ({c.kind} criterion: {rule}) in at "
        f"least {c.min_prompt_fraction:.0%} of the {n_prompts} prompts"
        + (f"; {hint}" if hint else "")
    )


# ------------------------------------------------------------------------------------------
# units: distinct measurements of the massive token
# ------------------------------------------------------------------------------------------


def no_sink_why(layer: int | None, position: int) -> str:
    """The one wording of "no sink head after ``layer`` attends to ``position``"."""
    return (
        f"no sink head: no head after layer {layer} attends to position {position} with at least "
        f"{claims.threshold('sink_attention'):g} (threshold 'sink_attention')"
    )


@dataclass(frozen=True)
class Units:
    """The prompts grouped by their massive token's prefix, and the seeded halves of the groups.

    Attributes:
        keys: per prompt, the token ids of ``x[: m + 1]`` (``m`` its massive token) as a string: what
            makes two prompts distinct measurements of the massive token (``claims.Sample.keys``).
        groups: per unit (distinct key, in order of first appearance), its prompts.
        select: the units the held-out claims select on (``claims.halves``; all units when there are
            fewer than 2, then nothing is held out).
        heldout: the units they are tested on.
    """

    keys: tuple[str, ...]
    groups: tuple[tuple[int, ...], ...]
    select: tuple[int, ...]
    heldout: tuple[int, ...]

    @property
    def n(self) -> int:
        """The number of distinct measurements (units)."""
        return len(self.groups)

    @property
    def held_out(self) -> bool:
        """Whether selection and test are on different units (at least 2 units)."""
        return self.n >= 2

    def prompts(self, units: Sequence[int]) -> list[int]:
        """The prompts of ``units``, sorted."""
        return sorted(p for u in units for p in self.groups[u])

    def label(self, u: int) -> str:
        g = self.groups[u]
        if len(g) == 1:
            return f"prompt {g[0]}"
        return f"prompts {g[0]}…{g[-1]} ({len(g)}, one massive-token prefix)"

    def text(self) -> str:
        """How the prompts were split, for a claim's details."""
        n_prompts = len(self.keys)
        if not self.held_out:
            return (
                f"every one of the {n_prompts} prompts has the same massive-token prefix: one "
                "distinct measurement, nothing to hold out (not decided)"
            )
        same = "" if self.n == n_prompts else f" ({self.n} distinct massive-token prefixes)"
        return (
            f"selected on {len(self.prompts(self.select))} prompts, tested on the other "
            f"{len(self.prompts(self.heldout))}{same}"
        )


def massive_units(tokens: torch.Tensor, reference: Sequence[int], seed: int) -> Units:
    """:class:`Units` of a batch (``tokens[b, : reference[b] + 1]`` is prompt ``b``'s key)."""
    keys = tuple(
        " ".join(str(int(t)) for t in tokens[b, : int(r) + 1].tolist())
        for b, r in enumerate(reference)
    )
    order = list(dict.fromkeys(keys))
    groups = tuple(tuple(b for b, k in enumerate(keys) if k == u) for u in order)
    if len(groups) < 2:
        every = tuple(range(len(groups)))
        return Units(keys, groups, every, every)
    sel, held = claims.halves(len(groups), seed)
    return Units(keys, groups, tuple(int(u) for u in sel), tuple(int(u) for u in held))


def subset_scan(scan: NormScan, rows: Sequence[int]) -> NormScan:
    """The norm scan of the prompts ``rows`` only (the prompt kept for the heatmap is dropped)."""
    idx = torch.as_tensor(list(rows), dtype=torch.long)
    return replace(
        scan,
        norms=scan.norms[:, :, idx],
        top_abs=scan.top_abs[:, idx],
        top_dims=scan.top_dims[:, idx],
        median_abs=scan.median_abs[:, idx],
        mask=scan.mask[idx],
        kept_prompt=-1,
    )


# ------------------------------------------------------------------------------------------
# the site
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Site:
    """Where the massive activation is on one batch (see the module docstring).

    Attributes:
        location: the ME-layer probe's full answer (every event, per-layer statistics).
        layer: the layer to study: ``given`` by the user, else the detected ME layer (``None`` only
            when neither exists; then :attr:`why_not` says so).
        given: whether ``layer`` was given rather than detected.
        reference: per prompt, its massive token (see the module docstring).
        positions: per prompt, every massive position at ``layer`` (empty where none).
        dims: the massive dims at ``layer``, commonest first.
        units: the prompts grouped by their massive token's prefix (the effective n).
        n_prompts: the number of prompts located on.
        batch: the prompts it was located on.
        scan: their norm scan (the caller's, or the one :func:`locate` ran).
        inputs: what the experiment built to locate it on (its ``inputs`` hook's answer, kept for
            its ``run``: ``me_interp.study.prepare``); ``None`` when located directly.
    """

    location: MELocation
    layer: int | None
    given: bool
    reference: tuple[int, ...]
    positions: tuple[tuple[int, ...], ...]
    dims: tuple[int, ...]
    units: Units
    n_prompts: int
    batch: Any = field(default=None, repr=False, compare=False)
    scan: NormScan | None = field(default=None, repr=False, compare=False)
    inputs: Any = field(default=None, repr=False, compare=False)

    @property
    def me_layer(self) -> int | None:
        """The detected ME layer (``None`` when the model shows none on these prompts)."""
        return self.location.me_layer

    @property
    def detected(self) -> bool:
        """Whether the probe found an ME layer."""
        return self.location.me_layer is not None

    @property
    def at_layer(self) -> bool:
        """Whether the probe finds a massive activation at the output of ``layer``."""
        return self.layer is not None and bool(self.location.layer_has_massive[self.layer])

    @property
    def massive(self) -> bool:
        """Whether the claims about a massive activation at ``layer`` apply."""
        return self.detected and self.at_layer

    @property
    def position(self) -> int:
        """The massive position: the commonest reference over prompts (the smallest on a tie)."""
        return Counter(self.reference).most_common(1)[0][0]

    @property
    def token_positions(self) -> list[list[int]]:
        """Per prompt, its massive positions at ``layer``, or its reference token where none."""
        return [list(p) if p else [r] for p, r in zip(self.positions, self.reference)]

    @property
    def why_not(self) -> str | None:
        """Why the claims about a massive activation at ``layer`` are not applicable (``None``: they
        apply)."""
        if not self.detected:
            given = f" (layer {self.layer} was given)" if self.given else ""
            return no_massive_why(self.location, self.n_prompts) + given
        if not self.at_layer:
            return (
                f"no massive activation at the output of the given layer {self.layer} (the "
                f"ME-layer probe finds the ME layer at {self.me_layer}): there is none to study there"
            )
        return None

    def sink_why_not(self, sink_heads: Callable[[], list]) -> str | None:
        """Why the sink claims at this site are not applicable: :attr:`why_not`, or no head after
        ``layer`` attends to the massive position with at least the ``sink_attention`` threshold
        (``sink_heads()`` is asked only when there is a massive activation); ``None``: they apply."""
        if not self.massive:
            return self.why_not
        if not sink_heads():
            return no_sink_why(self.layer, self.position)
        return None

    def __repr__(self) -> str:  # the headline numbers, not the location's per-layer lists
        where = "given" if self.given else "the detected ME layer"
        head = f"Site(layer={self.layer} ({where}; ME layer {self.me_layer})"
        if self.why_not is not None:
            return f"{head}, not applicable: {self.why_not})"
        return (
            f"{head}, position {self.position}, dims {list(self.dims[:8])}; {self.n_prompts} "
            f"prompt(s) in {self.units.n} unit(s))"
        )

    def require(self, hint: str = "pass --layer to study a chosen layer anyway") -> int:
        """The layer to study; raises :class:`claims.NotApplicable` when there is none (no
        massive activation and no layer given)."""
        if self.layer is None:
            raise claims.NotApplicable(no_massive_why(self.location, self.n_prompts, hint))
        return self.layer

    def to_dict(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "layer_1based": None if self.layer is None else self.layer + 1,
            "position": self.position,
            "dims": list(self.dims),
            "detected": self.detected,
            "at_layer": self.at_layer,
            "me_layer": self.me_layer,
            "given": self.given,
            "n_units": self.units.n,
        }


SCAN_SITES = ("resid_pre", "resid_mid", "resid_post")
"""What :func:`locate` scans when it is given no scan: the block input, the attention output and the
layer output (the event's jump and its site need all three)."""


def locate(
    model: LoadedModel,
    batch: Prompts,
    *,
    scan: NormScan | None = None,
    criterion: Criterion | None = None,
    layer: int | None = None,
    position: int | None = None,
    seed: int = 0,
) -> Site:
    """Locate the massive activation on ``batch`` (see the module docstring).

    Args:
        model: the :class:`~me_interp.models.LoadedModel`.
        batch: a prompt ``str``, a list of prompts or a :class:`~me_interp.models.Batch`.
        scan: the batch's norm scan, when the caller already ran one (else :data:`SCAN_SITES` are
            scanned here, one forward pass).
        criterion: the massive-activation criterion (default: :class:`Criterion`'s).
        layer: study this layer instead of the detected ME layer.
        position: every prompt's massive token is this position (e.g. 0) instead of the detected
            one.
        seed: seeds the halves of :attr:`Site.units`.

    Raises:
        ValueError: ``layer`` out of range, or ``position`` past a prompt's end.
    """
    batch = as_batch(model, batch)
    if layer is not None:
        model.check_layer(layer)
    if scan is None:
        scan = scan_norms(model, batch, SCAN_SITES)
    loc = locate_me_layer(scan, criterion)
    crit = loc.criterion
    n = int(scan.mask.shape[0])
    at = loc.me_layer if layer is None else layer
    if at is None:
        reference: list[int] = [0] * n
        positions: list[list[int]] = [[] for _ in range(n)]
        dims: tuple[int, ...] = ()
    elif at == loc.me_layer:
        reference = list(loc.reference_positions)
        positions = [list(p) for p in loc.massive_positions]
        dims = tuple(loc.massive_dims)
    else:
        reference = massive_reference(scan, crit, at)
        positions = [
            torch.nonzero(row).flatten().tolist() for row in massive_tokens(scan, crit)[at]
        ]
        dims = ()
    if position is not None:
        if not 0 <= position < min(batch.lengths):
            raise ValueError(
                f"position {position} is outside the shortest prompt ({min(batch.lengths)} tokens)"
            )
        reference = [int(position)] * n
    if at is not None and not dims:  # the largest |a| of the massive token there, commonest
        top = scan.top_dims[at, torch.arange(n), torch.as_tensor(reference), 0]
        dims = (Counter(top.tolist()).most_common(1)[0][0],)
    return Site(
        location=loc,
        layer=at,
        given=layer is not None,
        reference=tuple(int(r) for r in reference),
        positions=tuple(tuple(int(t) for t in p) for p in positions),
        dims=tuple(int(d) for d in dims),
        units=massive_units(batch.right_aligned().tokens, reference, seed),
        n_prompts=n,
        batch=batch,
        scan=scan,
    )


def selected_layer(site: Site) -> int | None:
    """The layer the held-out claims test: the ME layer detected on the selection half of the
    units alone (``None`` when that half has none); ``site.layer`` when given or when nothing can be
    held out (fewer than 2 units)."""
    units = site.units
    if site.given or not units.held_out:
        return site.layer
    assert site.scan is not None  # locate keeps the scan it located on
    half = subset_scan(site.scan, units.prompts(units.select))
    return locate_me_layer(half, site.location.criterion).me_layer


__all__ = [
    "NO_MASSIVE",
    "SCAN_SITES",
    "Site",
    "Units",
    "locate",
    "massive_units",
    "no_massive_why",
    "selected_layer",
    "subset_scan",
]
