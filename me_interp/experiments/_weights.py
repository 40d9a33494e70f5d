"""What the four weight experiments share: config fields, the unedited setup, and one measurement.

``weight_swap``, ``weight_patching``, ``rmsnorm_permutation`` and ``ffn_svd_ablation`` each edit the
weights of one layer (a context manager of ``me_interp.edits`` that restores them) and locate the
massive activation again on short prompts. :func:`prepare` loads the model and prompts, measures the
unedited model and resolves the layer to edit; :func:`measure` measures the model as it is (inside an
edit); :func:`edit_row` and :func:`edit_cells` are the per-edit result row and summary cells of the
experiments that edit the ME layer itself.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from me_interp.experiments.common import CommonConfig, model_for
from me_interp.models import Batch, LoadedModel
from me_interp.probes.attention import attention_stats
from me_interp.probes.massive import Criterion, MELocation, locate_me_layer
from me_interp.probes.norms import scan_norms

SCAN_SITES = ("resid_pre", "resid_mid", "resid_post")


@dataclass(frozen=True)
class WeightConfig(CommonConfig):
    """Fields shared by the weight experiments.

    Attributes:
        layer: the layer to edit (0-based); ``None`` = the ME layer detected on the unedited model.
        n_prompts: how many prompts to use (the first ones of the set); ``0`` = all.
        max_tokens: cut every prompt to its first ``max_tokens`` tokens (short prompts keep the many
            forwards fast; ``0`` = no cut).
        criterion: massive-activation criterion of ``probes.massive`` (sun, norm, either, both).
        sink: also measure the attention sink (one more forward per condition).
    """

    layer: int | None = None
    n_prompts: int = 4
    max_tokens: int = 12
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
    """The massive activation and the sink in one (possibly edited) model; lists are per layer."""

    me_layer: int | None
    event_layers: list[int]
    has_massive: list[bool]
    top_ratio: list[float]
    max_over_median: list[float]
    sink: list[float] = field(default_factory=list)

    def ratio_at(self, layer: int) -> float:
        return self.top_ratio[layer]

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


def edit_row(after: Measurement, layer: int, **what: Any) -> dict[str, Any]:
    """One row of an experiment that edits ``layer`` itself: ``what`` (the edit), then whether
    ``layer``'s output is still massive and :meth:`Measurement.at_layer` of ``after``."""
    m = after.at_layer(layer)
    return {
        **what,
        "me_layer": m["me_layer"],
        "survives": after.has_massive[layer],
        "ratio_at_layer": m["ratio_at_layer"],
        "ratio_last": m["ratio_last"],
        "sink_downstream": m["sink_downstream"],
        "top_ratio": after.top_ratio,
    }


EDIT_COLUMNS = ("ME after", "survives", "ratio@ME", "ratio@last")


def edit_cells(row: dict[str, Any]) -> tuple[Any, ...]:
    """The summary-table cells (:data:`EDIT_COLUMNS`) of an :func:`edit_row` row."""
    return (
        row["me_layer"],
        "yes" if row["survives"] else "no",
        row["ratio_at_layer"],
        row["ratio_last"],
    )


def measure(
    model: LoadedModel,
    batch: Batch,
    criterion: Criterion,
    positions: Sequence[Sequence[int]] | None = None,
    sink: bool = True,
) -> Measurement:
    """Locate the ME layer and (``sink=True``) the attention sink on ``positions`` in ``model`` as it is.

    ``sink[l]`` = mean over prompts of the largest head's mean attention mass (queries ``q ≥ 1``) on the
    positions ``positions[b]`` (default ``[0]``).
    """
    return _measurement(model, batch, locate(model, batch, criterion), positions, sink)


def locate(model: LoadedModel, batch: Batch, criterion: Criterion) -> MELocation:
    """The ME-layer location from token norms at :data:`SCAN_SITES` (``probes.massive``)."""
    return locate_me_layer(scan_norms(model, batch, SCAN_SITES), criterion)


def _measurement(model, batch, loc, positions, sink: bool) -> Measurement:
    sink_mass: list[float] = []
    if sink:
        stats = attention_stats(model, batch, positions)
        sink_mass = stats.to_positions.amax(-1).mean(-1).tolist()  # [layer batch head] → [layer]
    return Measurement(
        me_layer=loc.me_layer,
        event_layers=[e.layer for e in loc.events],
        has_massive=loc.layer_has_massive,
        top_ratio=loc.top_ratio,
        max_over_median=loc.max_over_median,
        sink=sink_mass,
    )


def short_batch(
    model: LoadedModel, prompts: Sequence[str], n_prompts: int, max_tokens: int
) -> Batch:
    """The first ``n_prompts`` prompts (0 = all), each cut to ``max_tokens`` tokens (0 = no cut)."""
    chosen = list(prompts)[: n_prompts or None]
    batch = model.tokenize(chosen)
    if not max_tokens:
        return batch
    rows = [batch.tokens[i, : min(n, max_tokens)].tolist() for i, n in enumerate(batch.lengths)]
    return model.batch_from_ids(rows, prompts=tuple(chosen))


@dataclass(frozen=True)
class Setup:
    """The model, the prompts, the unedited measurement and the layer to edit."""

    model: LoadedModel
    batch: Batch
    criterion: Criterion
    baseline: Measurement
    layer: int | None
    positions: list[list[int]]
    location: MELocation


def prepare(
    cfg: WeightConfig, model: LoadedModel | None = None, require_layer: bool = True
) -> Setup:
    """Load the model and prompts, measure the unedited model, resolve ``cfg.layer``.

    Raises:
        ValueError: ``cfg.layer`` out of range, or ``cfg.layer=None``, ``require_layer`` and no ME
            layer is found.
    """
    model = model_for(cfg, model)
    batch = short_batch(model, cfg.load_prompts(), cfg.n_prompts, cfg.max_tokens)
    crit = cfg.detection()
    loc = locate(model, batch, crit)
    if cfg.layer is None:
        if loc.me_layer is None and require_layer:
            raise ValueError(
                f"no ME layer found in {model.name} with the {crit.kind!r} criterion: pass --layer"
            )
        layer = loc.me_layer
    else:
        layer = model.check_layer(cfg.layer)
    positions = [list(p) if p else [r] for p, r in zip(_positions(loc), loc.reference_positions)]
    baseline = _measurement(model, batch, loc, positions, cfg.sink)
    return Setup(model, batch, crit, baseline, layer, positions, loc)


def _positions(loc) -> list[list[int]]:
    return loc.massive_positions or [[] for _ in loc.reference_positions]


def check_layers(model: LoadedModel, layers: Sequence[int], what: str) -> list[int]:
    """Validate layer indices (clear error naming ``what``)."""
    out = []
    for layer in layers:
        try:
            out.append(model.check_layer(layer))
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None
    return out
