"""What the weight experiments share: config fields, the unedited setup, and one measurement.

``weight_swap``, ``weight_patching``, ``rmsnorm_permutation`` and ``ffn_svd_ablation`` each edit the
weights of one layer (a context manager of ``me_interp.edits`` that restores them) and locate the
massive activation again. :func:`prepare` loads the model and prompts, measures the unedited model and
resolves the layer to edit (raising :class:`me_interp.claims.NotApplicable` when the model has no
massive activation and no layer was given); :func:`measure` measures the model as it is (inside an
edit) in **one** forward pass; :func:`edit_row` and :func:`edit_cells` are the per-edit result row and
summary cells of the experiments that edit the ME layer itself; :func:`depth_label` and
:func:`majority` are how the swap / patch claims name and decide one partner layer's outcome.

Every edit needs a forward, so these experiments subsample: ``n_prompts`` prompts spread evenly over
the set (:func:`spread`), each cut to ``max_tokens`` tokens. The result reports how many were used.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch

from me_interp import names
from me_interp.claims import NotApplicable
from me_interp.edits import PARTS
from me_interp.loading.loaded import Batch, LoadedModel
from me_interp.probes.attention import mean_to_keys
from me_interp.probes.batching import Chunk, Prefix, capture_prefix, give_up, record
from me_interp.probes.massive import Criterion, MELocation, locate_me_layer, prompt_me_layers
from me_interp.probes.norms import NormRecorder, NormScan, scan_norms, top_ratio
from me_interp.prompts import spread
from me_interp.study import INDEX_CONVENTION, CommonConfig, model_for

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
        criterion: massive-activation criterion of ``probes.massive`` (sun, norm, either, both).
        sink: also measure the attention sink (in the same forward pass).
    """

    layer: int | None = None
    n_prompts: int = 8
    max_tokens: int = 16
    criterion: str = "sun"
    sink: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_prompts < 0:
            raise ValueError(f"n_prompts must be >= 0 (0 = all), got {self.n_prompts}")
        if self.max_tokens != 0 and self.max_tokens < 2:
            raise ValueError(f"max_tokens must be >= 2 (or 0 = no cut), got {self.max_tokens}")
        self.detection()

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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def at_layer(self, layer: int) -> dict[str, Any]:
        """The ME layer, the massive ratio at ``layer`` and at the last layer, and the sink after
        ``layer``: the ``baseline`` block of a result and the measures of :func:`edit_row`."""
        return {
            "me_layer": self.me_layer,
            "ratio_at_layer": self.ratio_at(layer),
            "ratio_last": self.top_ratio[-1],
            "sink_downstream": self.sink_after(layer),
        }


def run_header(result: Any) -> dict[str, Any]:
    """The fields every weight experiment's ``result.json`` opens with (model, BOS, the edited
    layer in both conventions, whether it was given)."""
    return {
        "model": result.model,
        "bos": result.bos,
        "index_convention": INDEX_CONVENTION,
        "layer": result.layer,
        "layer_1based": result.layer + 1,
        "layer_given": result.layer_given,
    }


def edit_row(
    after: Measurement, layer: int, *, per_prompt: bool = False, **what: Any
) -> dict[str, Any]:
    """One row of an experiment that edits ``layer`` itself: ``what`` (the edit), then whether
    ``layer``'s output is still massive and :meth:`Measurement.at_layer` of ``after``; with
    ``per_prompt``, also the per-prompt ratios at ``layer`` and at the last layer (the units of an
    interval over prompts)."""
    m = after.at_layer(layer)
    row = {
        **what,
        "me_layer": m["me_layer"],
        "survives": after.has_massive[layer],
        "ratio_at_layer": m["ratio_at_layer"],
        "ratio_last": m["ratio_last"],
        "sink_downstream": m["sink_downstream"],
        "top_ratio": after.top_ratio,
    }
    if per_prompt:
        row["ratio_at_layer_per_prompt"] = after.prompt_ratio_at(layer)
        row["ratio_last_per_prompt"] = after.prompt_ratio[-1]
    return row


EDIT_COLUMNS = ("ME after", "survives", "ratio@ME", "ratio@last")


def edit_cells(row: dict[str, Any]) -> tuple[Any, ...]:
    """The summary-table cells (:data:`EDIT_COLUMNS`) of an :func:`edit_row` row."""
    return (
        row["me_layer"],
        "yes" if row["survives"] else "no",
        row["ratio_at_layer"],
        row["ratio_last"],
    )


def depth_label(layer: int, ref: int, name: str = "m") -> str:
    """A layer named with its depth relative to ``ref`` (the ME layer): ``"layer 3 (m-8)"``."""
    return f"layer {layer} ({name}{layer - ref:+d})"


def majority(flags: Sequence[bool]) -> bool:
    """Whether more than half of ``flags`` (one per prompt) are true: how the swap / patch claims
    decide one partner layer's outcome from its prompts (a tie is no)."""
    return 2 * sum(bool(f) for f in flags) > len(flags)


def where_edited(result: Any) -> str:
    """Where an edit experiment acted: the layer, its unedited mean norm ratio and the prompts."""
    m = result.layer
    r_m = sum(result.baseline.prompt_ratio_at(m)) / len(result.baseline.prompt_ratio_at(m))
    return (
        f"layer {m} (1-based {m + 1}); unedited R_m = {fmt_value(r_m)} (mean over "
        f"{result.n_prompts} prompts of {max(result.prompt_lengths)} tokens at most)"
    )


def fmt_value(x: Any) -> str:
    """A summary-line number in four significant digits, ``n/a`` for a missing or NaN value."""
    return "n/a" if x is None or x != x else f"{x:.4g}"


# ------------------------------------------------------------------------------------------
# measuring
# ------------------------------------------------------------------------------------------


class SinkRecorder:
    """Records ``out[l, b, h] = Σ_{p∈P_b} mean_{q>p} A_{l,b,h}[q, p]``: the attention mass every head
    puts on the reference positions ``P_b`` from the real queries that can see them (as
    ``probes.attention``: :func:`~me_interp.probes.attention.mean_to_keys`), chunk by chunk
    (``probes.batching``), so that it shares the forward pass of the norm scan."""

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


def locate(model: LoadedModel, batch: Batch, criterion: Criterion) -> MELocation:
    """The ME-layer location from token norms at :data:`SCAN_SITES` (``probes.massive``)."""
    return locate_me_layer(scan_norms(model, batch, SCAN_SITES), criterion)


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
    """The model, the prompts, the unedited measurement and the layer to edit.

    Attributes:
        layer_given: whether the layer came from ``cfg.layer`` (else it is the detected ME layer).
    """

    model: LoadedModel
    batch: Batch
    criterion: Criterion
    baseline: Measurement
    layer: int | None
    positions: list[list[int]]
    location: MELocation
    layer_given: bool = False
    sink: bool = True
    scan: NormScan | None = None
    sink_mass: torch.Tensor | None = None
    unedited: dict[str, Unedited] = field(default_factory=dict, compare=False, repr=False)

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


def no_massive_activation(
    model: LoadedModel, crit: Criterion, n_prompts: int, hint: str = "to edit a layer anyway"
) -> NotApplicable:
    """The "not applicable" of a model without a massive activation (and no layer given)."""
    return NotApplicable(
        f"no massive activation on this model: no layer output of {model.name} meets the "
        f"{crit.kind!r} criterion on {n_prompts} prompts (pass --layer {hint})"
    )


def prepare(
    cfg: WeightConfig, model: LoadedModel | None = None, require_layer: bool = True
) -> Setup:
    """Load the model and prompts, measure the unedited model, resolve ``cfg.layer``.

    Raises:
        NotApplicable: ``cfg.layer=None``, ``require_layer`` and the model has no ME layer.
        ValueError: ``cfg.layer`` out of range.
    """
    model = model_for(cfg, model)
    batch = short_batch(model, cfg.load_prompts(), cfg.n_prompts, cfg.max_tokens)
    crit = cfg.detection()
    if cfg.layer is not None:
        model.check_layer(cfg.layer)
    loc = locate(model, batch, crit)
    if cfg.layer is None:
        if loc.me_layer is None and require_layer:
            raise no_massive_activation(model, crit, len(batch))
        layer = loc.me_layer
    else:
        layer = cfg.layer
    positions = [list(p) if p else [r] for p, r in zip(_positions(loc), loc.reference_positions)]
    baseline, _, scan, sink = _measure(model, batch, crit, positions, cfg.sink)
    return Setup(
        model,
        batch,
        crit,
        baseline,
        layer,
        positions,
        loc,
        cfg.layer is not None,
        cfg.sink,
        scan,
        sink,
    )


def _positions(loc) -> list[list[int]]:
    return loc.massive_positions or [[] for _ in loc.reference_positions]
