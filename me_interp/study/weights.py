"""What the weight experiments share: their inputs, the parts a swap or patch moves, one outcome.

``weight_swap``, ``weight_patching``, ``rmsnorm_permutation``, ``ffn_svd_ablation`` and
``super_weight`` edit the weights of one layer (``me_interp.edits``) and locate the massive
activation again (``probes.measurement``). Their Config is
:class:`~me_interp.study.config.WeightConfig`; :func:`inputs` is the batch their Site is located on
(``n_prompts`` spread over the set, each cut to ``max_tokens``: every edit costs a forward);
:func:`setup` adds the unedited model's measurement to the framework's model and Site;
:func:`depth_label` and :func:`majority` name and decide one partner layer's outcome in the swap /
patch claims.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from me_interp.edits import PARTS
from me_interp.interventions.core import check_layers
from me_interp.loading.loaded import Batch, LoadedModel
from me_interp.probes.measurement import Setup, short_batch
from me_interp.probes.site import Site
from me_interp.study.config import WeightConfig
from me_interp.study.experiment import Experiment, prepare

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


def inputs(cfg: WeightConfig, model: LoadedModel) -> Batch:
    """The batch a weight experiment's Site is located on: ``cfg.n_prompts`` prompts spread over
    the set, each cut to ``cfg.max_tokens`` tokens (``probes.measurement.short_batch``)."""
    return short_batch(model, cfg.load_prompts(), cfg.n_prompts, cfg.max_tokens)


@dataclass(frozen=True)
class PartModules:
    """The HF modules (names within a decoder layer) one part of ``me_interp.edits.PARTS`` moves."""

    part: str
    modules: list[str]


def given_layers(
    given: Sequence[int], model: LoadedModel, flag: str, own: int | None, refusal: str
) -> list[int]:
    """The layers given by ``flag`` (``--partners``, ``--targets``), validated, in the order given.

    Raises:
        ValueError: a layer out of range, or ``own`` (the edited layer; ``None``: none) among them:
            "``flag`` contains the ``refusal``".
    """
    layers = list(check_layers(given, model.n_layers, flag, sort=False))
    if own in layers:
        raise ValueError(f"{flag} contains the {refusal}")
    return layers


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


def setup(
    exp: Experiment,
    cfg: WeightConfig,
    model: LoadedModel | None = None,
    site: Site | None = None,
    require: bool = True,
) -> Setup:
    """A weight experiment's set-up: the framework's model and Site (:func:`prepare`, on
    :func:`inputs`) and the unedited model measured on the Site's batch (``Setup.at``).

    Raises:
        NotApplicable: with ``require``, no ``cfg.layer`` and no massive activation on the model.
    """
    model, site = prepare(exp, cfg, model, site)
    assert site is not None  # a weight experiment declares its inputs
    if require:
        site.require("pass --layer to edit a layer anyway")
    return Setup.at(model, site, cfg.detection(), cfg.sink)
