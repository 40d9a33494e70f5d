"""What the weight experiments share: config fields, the unedited setup, and one measurement.

``weight_swap``, ``weight_patching``, ``rmsnorm_permutation`` and ``ffn_svd_ablation`` each edit the
weights of one layer (a context manager of ``me_interp.edits`` that restores them) and locate the
massive activation again. :func:`prepare` loads the model and prompts, measures the unedited model and
resolves the layer to edit (raising :class:`me_interp.claims.NotApplicable` when the model has no
massive activation and no layer was given); :func:`measure` measures the model as it is (inside an
edit) in **one** forward pass; :class:`EditRow` is the per-edit result row (and its summary cells) of
the experiments that edit the ME layer itself, :class:`PartModules` what a swap or patch moved; :func:`depth_label` and
:func:`majority` are how the swap / patch claims name and decide one partner layer's outcome.

Every edit needs a forward, so these experiments subsample: ``n_prompts`` prompts spread evenly over
the set (:func:`spread`), each cut to ``max_tokens`` tokens. The result reports how many were used.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, get_args

import numpy as np
import torch

from me_interp.claims import excess_fraction
from me_interp.edits import PARTS
from me_interp.loading.loaded import Batch, LoadedModel
from me_interp.probes.attention import SinkRecorder
from me_interp.probes.batching import Prefix, capture_prefix, give_up, record
from me_interp.probes.massive import (
    Criterion,
    CriterionKind,
    MELocation,
    locate_me_layer,
    prompt_me_layers,
)
from me_interp.probes.norms import NormRecorder, NormScan, top_ratio
from me_interp.probes.site import Site, locate
from me_interp.prompts import spread
from me_interp.study import CommonConfig, checked, model_for

SCAN_SITES = ("resid_pre", "resid_mid", "resid_post")
PART_ORDER: tuple[str, ...] = (
    "ffn_path",
    "ffn_norm",
    "ffn",
    "attn_path",
    "attn_norm",
    "attn",
    "block",
)
"""Every part of ``me_interp.edits.PARTS``, in the order of the swap / patch claims (headline first)."""
PART_WHAT: dict[str, str] = {
    "ffn_path": "pre-FFN RMSNorm and FFN together, with the post-FFN norm on sandwich-norm models (the paper's RMSNorm–FFN pair)",
    "ffn_norm": "pre-FFN RMSNorm gain alone",
    "ffn": "FFN alone (without its norm gain)",
    "attn_path": "pre-attention RMSNorm and attention together (with the post-attention norm on sandwich-norm models)",
    "attn_norm": "pre-attention RMSNorm gain alone",
    "attn": "attention alone",
    "block": "whole block (attention included)",
}
"""What each part is, in the words of a claim."""
PART_SECTION: dict[str, str] = {
    "ffn_path": "§2.1, §2.3",
    "ffn_norm": "§2.2, §2.3",
    "ffn": "§2.3",
    "attn_path": "§2.6",
    "attn_norm": "§2.6",
    "attn": "§2.6",
    "block": "§2.1",
}
"""The paper.md section each part's swap / patch claim tests."""
if set(PART_ORDER) != set(PARTS):  # pragma: no cover - a new part must get a claim
    raise ImportError(f"PART_ORDER {PART_ORDER} does not list every part of {PARTS}")


@dataclass(frozen=True)
class WeightConfig(CommonConfig):
    """Fields shared by the weight experiments.

    Attributes:
        layer: the layer to edit (0-based); ``None`` = the ME layer detected on the unedited model
            (a model without one is then "not applicable").
        n_prompts: how many prompts to use, spread evenly over the prompt set (every edit costs a
            forward pass, so the default subsamples; ``0`` = all). The result reports the number.
        max_tokens: cut every prompt to its first ``max_tokens`` tokens (the massive token is among
            the first; ``0`` = no cut).
        criterion: massive-activation criterion (``sun``: value thresholds; ``norm``: token-norm
            ratio).
        sink: also measure the attention sink (in the same forward pass).
    """

    layer: int | None = None
    n_prompts: int = checked(8, ge=0)
    max_tokens: int = checked(16, ge=2, also=(0,))
    criterion: str = checked("sun", choices=get_args(CriterionKind))
    sink: bool = True

    def detection(self) -> Criterion:
        return Criterion(kind=self.criterion)  # type: ignore[arg-type]


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
            the units of a per-prompt majority (:func:`majority`).
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


@dataclass(frozen=True)
class PartModules:
    """The HF modules (names within a decoder layer) one part of ``me_interp.edits.PARTS`` moves."""

    part: str
    modules: list[str]


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


def depth_label(layer: int, ref: int, name: str = "m") -> str:
    """A layer named with its depth relative to ``ref`` (the ME layer): ``"layer 3 (m-8)"``."""
    return f"layer {layer} ({name}{layer - ref:+d})"


def majority(flags: Sequence[bool]) -> bool:
    """Whether more than half of ``flags`` (one per prompt) are true: how the swap / patch claims
    decide one partner layer's outcome from its prompts (a tie is no)."""
    return 2 * sum(bool(f) for f in flags) > len(flags)


def where_edited(result: Any) -> str:
    """Where an edit experiment acted: the layer, its unedited mean norm ratio and the prompts."""
    m = result.header.layer
    r_m = sum(result.baseline.prompt_ratio_at(m)) / len(result.baseline.prompt_ratio_at(m))
    return (
        f"layer {m} (1-based {m + 1}); unedited R_m = {fmt_value(r_m)} (mean over "
        f"{result.header.n_prompts} prompts of {max(result.prompt_lengths)} tokens at most)"
    )


def fmt_value(x: Any) -> str:
    """A summary-line number in four significant digits, ``n/a`` for a missing or NaN value."""
    return "n/a" if x is None or x != x else f"{x:.4g}"


# ------------------------------------------------------------------------------------------
# measuring
# ------------------------------------------------------------------------------------------


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


def prepare(
    cfg: WeightConfig, model: LoadedModel | None = None, require_layer: bool = True
) -> Setup:
    """Load the model and prompts, locate the massive activation (``probes.site.locate``), measure
    the unedited model.

    Raises:
        NotApplicable: ``cfg.layer=None``, ``require_layer`` and the model has no ME layer.
        ValueError: ``cfg.layer`` out of range.
    """
    model = model_for(cfg, model)
    batch = short_batch(model, cfg.load_prompts(), cfg.n_prompts, cfg.max_tokens)
    crit = cfg.detection()
    site = locate(model, batch, criterion=crit, layer=cfg.layer, seed=cfg.seed)
    if require_layer:
        site.require("pass --layer to edit a layer anyway")
    baseline, _, scan, sink = _measure(model, batch, crit, site.token_positions, cfg.sink)
    return Setup(model, batch, crit, baseline, site, cfg.sink, scan, sink)
