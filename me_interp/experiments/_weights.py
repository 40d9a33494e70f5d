"""What the weight experiments share: config fields, the parts a swap or patch moves, one edit's row.

``weight_swap``, ``weight_patching``, ``rmsnorm_permutation`` and ``ffn_svd_ablation`` edit the
weights of one layer (``me_interp.edits``) and locate the massive activation again
(``probes.measurement``). :func:`prepare` loads the model and prompts (``n_prompts`` spread over the
set, each cut to ``max_tokens``: every edit costs a forward), locates the Site and measures the
unedited model; :class:`EditRow` is what one edit of the ME layer itself left; :func:`depth_label`
and :func:`majority` name and decide one partner layer's outcome in the swap / patch claims.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, get_args

from me_interp.edits import PARTS
from me_interp.loading.loaded import LoadedModel
from me_interp.probes.massive import Criterion, CriterionKind
from me_interp.probes.measurement import (  # noqa: F401 - the weight experiments' names
    EDIT_COLUMNS,
    SCAN_SITES,
    EditRow,
    Measurement,
    Setup,
    _measure,
    measure,
    short_batch,
)
from me_interp.probes.site import locate
from me_interp.prompts import spread  # noqa: F401 - re-exported
from me_interp.study import CommonConfig, checked, model_for

PART_ORDER = ("ffn_path", "ffn_norm", "ffn", "attn_path", "attn_norm", "attn", "block")
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
class PartModules:
    """The HF modules (names within a decoder layer) one part of ``me_interp.edits.PARTS`` moves."""

    part: str
    modules: list[str]


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
