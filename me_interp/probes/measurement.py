"""The massive activation and the sink of a model as it is — edited or not — in one forward pass.

A weight experiment edits one layer (a context manager of ``me_interp.edits``) and locates the
massive activation again: :func:`measure` does it in **one** forward (length-sorted chunks, no
unembedding: ``probes.batching``); :class:`Setup` holds the unedited model's measurement and, after
:meth:`Setup.reuse_from`, replays the unedited prefix so that an edit starting at block ``s`` runs
blocks ``s..`` only (checked once against the full forward). :class:`EditRow` is what one edit of
a layer left there; :func:`short_batch` subsamples prompts: every edit costs a forward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from me_interp.claims import excess_fraction
from me_interp.loading.loaded import Batch, LoadedModel
from me_interp.probes.attention import SinkRecorder
from me_interp.probes.batching import Prefix, capture_prefix, give_up, record
from me_interp.probes.massive import Criterion, MELocation, locate_me_layer, prompt_me_layers
from me_interp.probes.norms import NormRecorder, NormScan, top_ratio
from me_interp.probes.site import Site
from me_interp.prompts import spread

SCAN_SITES = ("resid_pre", "resid_mid", "resid_post")


@dataclass(frozen=True)
class Measurement:
    """The massive activation and the sink in one (possibly edited) model; lists are per layer.

    Attributes:
        me_layer: the ME layer located in this model (``None``: no layer output is massive).
        event_layers: the first layer of every emergence event.
        has_massive: per layer, whether its output has a massive activation.
        top_ratio: per layer, the median over prompts of ``R_{l,b} = max_t ‖h_{l,b,t}‖ /
            mean_{t≠argmax} ‖h_{l,b,t}‖``.
        max_over_median: per layer, median over prompts of ``max|a| / median|a|``.
        sink: per layer, mean over prompts of the largest head's attention mass (queries ``q ≥ 1``)
            on the reference positions (empty without ``sink``).
        prompt_ratio: ``[layer][prompt]`` the per-prompt ``R_{l,b}`` behind ``top_ratio``.
        prompt_me_layer: per prompt, the ME layer located on that prompt alone (``None``: none);
            the units of a per-prompt majority (``study.weights.majority``).
    """

    me_layer: int | None
    event_layers: list[int]
    has_massive: list[bool]
    top_ratio: list[float]
    max_over_median: list[float]
    sink: list[float] = field(default_factory=list)
    prompt_ratio: list[list[float]] = field(default_factory=list)
    prompt_me_layer: list[int | None] = field(default_factory=list)

    def ratio_at(self, layer: int) -> float:
        return self.top_ratio[layer]

    def prompt_ratio_at(self, layer: int) -> list[float]:
        """Per prompt: ``R_{layer,b}``."""
        return self.prompt_ratio[layer]

    def sink_after(self, layer: int | None) -> float:
        """Mean sink mass over the layers after ``layer`` (NaN without sink data or later layers)."""
        start = 0 if layer is None else layer + 1
        vals = self.sink[start:]
        return float(sum(vals) / len(vals)) if vals else math.nan


def measure(
    model: LoadedModel,
    batch: Batch,
    criterion: Criterion,
    positions: Sequence[Sequence[int]] | None = None,
    sink: bool = True,
) -> Measurement:
    """Locate the ME layer and (``sink=True``) the attention sink on ``positions`` in ``model`` as it
    is, in one forward pass (length-sorted chunks, no unembedding: ``probes.batching``).

    ``sink[l]`` = mean over prompts of the largest head's mean attention mass (queries ``q ≥ 1``) on the
    positions ``positions[b]`` (default ``[0]``).
    """
    return _measure(model, batch, criterion, positions, sink)[0]


def _same(a: Measurement, b: Measurement) -> str | None:
    """Where two measurements differ (beyond rtol 1e-4 / atol 1e-5), or ``None``."""
    for k, va in asdict(a).items():
        x, y = np.asarray(va, dtype=np.float64), np.asarray(getattr(b, k), dtype=np.float64)
        if x.shape != y.shape or not np.allclose(x, y, rtol=1e-4, atol=1e-5, equal_nan=True):
            return k
    return None


@dataclass(frozen=True)
class Unedited:
    """The unedited model's forward of a batch, for measuring edits that start at a later block:
    its block inputs (``probes.batching``), its norm scan and its per-head sink mass (``None``
    without the sink)."""

    prefix: Prefix
    scan: NormScan
    sink: torch.Tensor | None


def _measure(
    model, batch, criterion, positions, sink: bool, unedited: Unedited | None = None, start: int = 0
) -> tuple[Measurement, MELocation, NormScan, torch.Tensor | None]:
    per = [[0] for _ in range(len(batch))] if positions is None else [list(p) for p in positions]
    norms = NormRecorder(model, batch, SCAN_SITES)
    sinks = SinkRecorder(model, batch, per) if sink else None
    recs = [norms] if sinks is None else [norms, sinks]
    if unedited is None or not start:
        record(model, batch, recs)
        scan = norms.result()
    else:  # blocks start.. only; the layers before are the unedited run's
        record(model, batch, recs, prefix=unedited.prefix, start=start)
        scan = norms.result(below=unedited.scan, start=start)
        if sinks is not None:
            sinks.out[:start] = unedited.sink[:start]
    loc = locate_me_layer(scan, criterion)
    m = Measurement(
        me_layer=loc.me_layer,
        event_layers=[e.layer for e in loc.events],
        has_massive=loc.layer_has_massive,
        top_ratio=loc.top_ratio,
        max_over_median=loc.max_over_median,
        sink=[] if sinks is None else sinks.per_layer(),
        prompt_ratio=top_ratio(scan.site_norms("resid_post"), scan.mask).tolist(),  # [layer][b]
        prompt_me_layer=prompt_me_layers(scan, criterion),
    )
    return m, loc, scan, None if sinks is None else sinks.out


def short_batch(
    model: LoadedModel, prompts: Sequence[str], n_prompts: int, max_tokens: int
) -> Batch:
    """``n_prompts`` prompts spread evenly over ``prompts`` (:func:`spread`; 0 = all), each cut to
    ``max_tokens`` tokens (0 = no cut)."""
    chosen = spread(prompts, n_prompts)
    batch = model.tokenize(chosen)
    if not max_tokens:
        return batch
    rows = [batch.tokens[i, : min(n, max_tokens)].tolist() for i, n in enumerate(batch.lengths)]
    return model.batch_from_ids(rows, prompts=tuple(chosen))


@dataclass(frozen=True)
class Setup:
    """The model, the prompts, where the massive activation is, and the unedited measurement.

    Attributes:
        site: the massive activation located on the batch (``probes.site``): the layer to edit
            (``site.layer``, given or detected) and each prompt's massive tokens.
    """

    model: LoadedModel
    batch: Batch
    criterion: Criterion
    baseline: Measurement
    site: Site
    sink: bool = True
    scan: NormScan | None = None
    sink_mass: torch.Tensor | None = None
    unedited: dict[str, Unedited] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def at(cls, model: LoadedModel, site: Site, criterion: Criterion, sink: bool = True) -> Setup:
        """Measure the unedited model on the batch ``site`` was located on (its massive tokens'
        sink too, with ``sink``): the set-up of an edit experiment."""
        batch = site.batch
        baseline, _, scan, mass = _measure(model, batch, criterion, site.token_positions, sink)
        return cls(model, batch, criterion, baseline, site, sink, scan, mass)

    @property
    def layer(self) -> int | None:
        """The layer to edit: ``--layer`` if given, else the detected ME layer."""
        return self.site.layer

    @property
    def layer_given(self) -> bool:
        return self.site.given

    @property
    def location(self) -> MELocation:
        return self.site.location

    @property
    def positions(self) -> list[list[int]]:
        """Per prompt, its massive positions (its reference token where none)."""
        return self.site.token_positions

    def reuse_from(self, starts: Sequence[int]) -> None:
        """Capture the unedited model's block inputs once, so that :meth:`measure` of an edit
        starting at one of ``starts`` runs blocks ``start..`` only (call before any edit).

        Checked once against the baseline: the measurement from the largest start must equal the
        full forward's (rtol 1e-4); if it does not, edits are measured with full forwards, with a
        warning (an error under ``ME_INTERP_STRICT``)."""
        starts = sorted({int(x) for x in starts if x})
        if not starts or self.scan is None:
            return
        u = Unedited(capture_prefix(self.model, self.batch, starts), self.scan, self.sink_mass)
        got = _measure(
            self.model, self.batch, self.criterion, self.positions, self.sink, u, starts[-1]
        )[0]
        bad = _same(got, self.baseline)
        if bad is None:
            self.unedited["prefix"] = u
            return
        msg = (
            f"running blocks {starts[-1]}.. from the unedited prefix changed {bad} of the unedited "
            "measurement: edits are measured with full forwards (slower, same values)"
        )
        give_up(msg, stacklevel=3)

    def measure(self, model: LoadedModel | None = None, start: int = 0) -> Measurement:
        """:func:`measure` of the setup's batch on ``model`` (default: the setup's, as it is now,
        edited or not). ``start``: the first block an edit changes; blocks before it are taken from
        the unedited run when :meth:`reuse_from` captured ``start`` (and the model is the setup's,
        its parameters before ``start`` untouched: checked), else the whole forward runs."""
        model = self.model if model is None else model
        u = self.unedited.get("prefix")
        if u is None or model is not self.model or start not in u.prefix.starts:
            start = 0
        return _measure(model, self.batch, self.criterion, self.positions, self.sink, u, start)[0]


@dataclass(frozen=True)
class EditRow:
    """What one edit of layer ``m`` itself left (the edit's own fields come from a subclass).

    Attributes:
        me_layer: the ME layer located after the edit (``None``: none).
        survives: whether ``m``'s output is still massive.
        ratio_at_layer, ratio_last: the median norm ratio ``R`` at ``m`` and at the last layer;
            ``*_per_prompt``: per prompt (the units of an interval over prompts).
        sink_downstream: the mean sink after ``m``; ``top_ratio``: ``R`` per layer.
        change: the excess ``c = (R̄_m(edited) − 1) / (R̄_m(unedited) − 1)`` the edit leaves
            (``R̄`` the mean over prompts).
    """

    me_layer: int | None
    survives: bool
    ratio_at_layer: float
    ratio_last: float
    sink_downstream: float
    top_ratio: list[float]
    ratio_at_layer_per_prompt: list[float]
    ratio_last_per_prompt: list[float]
    change: float

    @classmethod
    def measured(cls, after: Measurement, baseline: Measurement, layer: int, **what: Any):
        """The row of an edit (``what``: the subclass's fields) that left ``after``."""
        per = after.prompt_ratio_at(layer)
        before = float(np.asarray(baseline.prompt_ratio_at(layer), dtype=np.float64).mean())
        return cls(
            **what,
            me_layer=after.me_layer,
            survives=after.has_massive[layer],
            ratio_at_layer=after.ratio_at(layer),
            ratio_last=after.top_ratio[-1],
            sink_downstream=after.sink_after(layer),
            top_ratio=after.top_ratio,
            ratio_at_layer_per_prompt=per,
            ratio_last_per_prompt=after.prompt_ratio[-1],
            change=excess_fraction(float(np.mean(per)), before),
        )

    def cells(self) -> tuple[Any, ...]:
        """The summary-table cells (:data:`EDIT_COLUMNS`)."""
        return (
            self.me_layer,
            "yes" if self.survives else "no",
            self.ratio_at_layer,
            self.ratio_last,
        )


EDIT_COLUMNS = ("ME after", "survives", "ratio@ME", "ratio@last")
