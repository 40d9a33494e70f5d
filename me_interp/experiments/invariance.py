"""Directional invariance: does the massive token point the same way for every input and every layer?

Tests paper.md §2 claim 4 (``probes.invariance``): per layer, the mean cosine of the massive token's layer
output across inputs **with different first tokens**, next to the trivial control (the same prompts with
their first token replaced by prompt 0's, so position 0 is identical across inputs by construction) and
the baseline of the other tokens (their mean cosine across the same pairs of inputs); the same for the
massive token's key per key/value head; cosine across layers; and norm stability (coefficient of
variation of ``‖h_m‖`` across inputs). The ME layer and massive tokens are detected.

Cost: one forward over every prompt (norms for the detection and the other tokens' directions), then
two forwards over the prefixes ``x[: m + 1]`` only (the massive token's state depends on nothing after
it): the prompts and the control.

The pairwise statistics are resampled by their units, not by pairs (``claims.pair_measure``). The
direction across layers is reported, not judged (any token's residual direction drifts slowly).

    python -m me_interp.experiments.invariance                 # bundled model, built-in prompts

``result.json`` keys are documented in docs/probes.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import plotly.graph_objects as go

from me_interp import claims, io, plotting
from me_interp.loading.loaded import Batch, LoadedModel
from me_interp.probes.batching import record
from me_interp.probes.invariance import (
    InvarianceRecorder,
    InvarianceScan,
    UnitSumRecorder,
    partner_mean,
    removed_misalignment,
    same_first_token_control,
)
from me_interp.probes.site import Site, massive_units
from me_interp.study import DetectConfig, Experiment, Inputs, command, prepare, scanned_inputs
from me_interp.study.layer_report import LayerReport, detect

NAME = "invariance"


@dataclass(frozen=True)
class Config(DetectConfig):
    """Invariance settings (those of :class:`DetectConfig`; the cosine thresholds of the claims are
    ``claims.THRESHOLDS['invariance_cos']`` and ``['invariance_gap']``)."""


@dataclass(frozen=True)
class Layer:
    """Per layer: the mean cosine of the massive token's state ``h_m`` across pairs of inputs
    (different first tokens; the same first token; the control batch), the other tokens' (and the
    gap), the keys' per key/value head, the cosine to the next layer and to the ME layer, and the
    norm's stability (std / mean across inputs, the mean norm)."""

    layer: int
    layer_1based: int
    cos_across_inputs: float
    cos_across_inputs_same_first_token: float
    cos_across_inputs_control: float
    others_cos_across_inputs: float
    cos_gap: float
    key_cos_across_inputs: list[float]
    key_cos_across_inputs_control: list[float]
    cos_next_layer: float
    cos_to_me_layer: float
    norm_cv: float
    mean_norm: float


@dataclass(frozen=True)
class PerPrompt:
    """``[prompt][layer]``: ``cos_to_inputs`` (mean cosine of the prompt's ``h_m`` to the prompts
    with a different first token), ``others_cos_to_inputs`` (the same for the other tokens' mean
    direction), ``control_cos_to_inputs`` (control batch, all other prompts), ``cos_to_me_layer``."""

    cos_to_inputs: list[list[float]]
    others_cos_to_inputs: list[list[float]]
    control_cos_to_inputs: list[list[float]]
    cos_to_me_layer: list[list[float]]


_TRANSIENT = {io.TRANSIENT: True}


@dataclass(frozen=True)
class Result(LayerReport):
    """What :func:`run` measured. ``scan`` / ``control`` hold the massive token's states and keys of
    the prompts and of the control batch (not written to ``result.json``; the pairwise matrices of
    the claims are computed from them)."""

    reference_positions: list[int]
    first_tokens: list[int]
    n_pairs_distinct: int
    n_pairs_same: int
    layers: list[Layer]
    cos_across_layers: list[list[float]]
    control_keys: list[str]
    per_prompt: PerPrompt
    scan: InvarianceScan | None = field(default=None, metadata=_TRANSIENT)
    control: InvarianceScan | None = field(default=None, metadata=_TRANSIENT)


def _states(model: LoadedModel, batch: Batch, ref: list[int]) -> InvarianceRecorder:
    """The massive token's states and keys, from the prefixes ``x_b[: m_b + 1]``."""
    rec = InvarianceRecorder(model, batch, ref)
    record(model, batch, [rec], upto=[r + 1 for r in ref])
    return rec


def inputs(cfg: Config, model: LoadedModel) -> Inputs:
    """The prompts and one forward pass: their norm scan and unit sums (``made``).

    Raises:
        ValueError: fewer than 2 prompts.
    """
    batch = model.tokenize(cfg.load_prompts())
    if len(batch) < 2:
        raise ValueError("the invariance experiment compares inputs: give at least 2 prompts")
    return scanned_inputs(model, batch, UnitSumRecorder(model, batch))


def run(cfg: Config, model: LoadedModel | None = None, site: Site | None = None) -> Result:
    """Measure directional invariance at every layer. No printing, no files.

    Raises:
        ValueError: fewer than 2 prompts.
        claims.NotApplicable: the model has no massive activation and ``cfg.layer`` is not given.
    """
    model, site = prepare(EXPERIMENT, cfg, model, site)
    batch, (units,) = site.batch, site.inputs.made
    det = detect(site)
    me, ref = det.me_layer, det.reference
    rec = _states(model, batch, ref)
    first = [int(t) for t in batch.tokens[:, 0].tolist()]
    scan = InvarianceScan(
        rec.states, rec.keys, first, rec.positions, others=units.others(rec.states)
    )
    ctrl_batch = same_first_token_control(batch)
    crec = _states(model, ctrl_batch, ref)
    ctrl = InvarianceScan(
        crec.states, crec.keys, [int(t) for t in ctrl_batch.tokens[:, 0].tolist()], crec.positions
    )
    cos_d = scan.cos_across_inputs(False)
    cos_s = scan.cos_across_inputs(True)
    cos_c = ctrl.cos_across_inputs(True)
    kd = scan.key_cos_across_inputs(False)
    kc = ctrl.key_cos_across_inputs(True)
    distinct, every = scan.pairs(False), ctrl.pairs(True)
    sym = lambda m: m | m.T  # noqa: E731
    cm, om = scan.cos_matrices(), scan.others_cos_matrices()
    per_layer_others = [
        float(om[i][distinct].mean()) if distinct.any() else float("nan") for i in range(len(om))
    ]
    cal = scan.cos_across_layers()
    cv = scan.norm_cv()
    norms_m = scan.mean_norm()
    L = scan.n_layers
    layers = [
        Layer(
            layer=i,
            layer_1based=i + 1,
            cos_across_inputs=cos_d[i],
            cos_across_inputs_same_first_token=cos_s[i],
            cos_across_inputs_control=cos_c[i],
            others_cos_across_inputs=per_layer_others[i],
            cos_gap=cos_d[i] - per_layer_others[i],
            key_cos_across_inputs=kd[i],
            key_cos_across_inputs_control=kc[i],
            cos_next_layer=float(cal[i, i + 1]) if i + 1 < L else float("nan"),
            cos_to_me_layer=float(cal[i, me]),
            norm_cv=cv[i],
            mean_norm=norms_m[i],
        )
        for i in range(L)
    ]
    per_prompt = PerPrompt(
        cos_to_inputs=partner_mean(cm, sym(distinct)).T.tolist(),
        others_cos_to_inputs=partner_mean(om, sym(distinct)).T.tolist(),
        control_cos_to_inputs=partner_mean(ctrl.cos_matrices(), sym(every)).T.tolist(),
        cos_to_me_layer=scan.cos_to_layers()[me].T.tolist(),
    )
    return Result(
        **det.report_fields(cfg, model, batch),
        reference_positions=ref,
        first_tokens=first,
        n_pairs_distinct=scan.n_pairs(False),
        n_pairs_same=scan.n_pairs(True),
        layers=layers,
        cos_across_layers=cal.tolist(),
        # the control batch's own massive-token prefixes (the header's are the prompts')
        control_keys=list(massive_units(ctrl_batch.tokens, ref, cfg.seed).keys),
        per_prompt=per_prompt,
        scan=scan,
        control=ctrl,
    )


def _scans(r: Result) -> tuple[InvarianceScan, InvarianceScan]:
    if r.scan is None or r.control is None:
        raise ValueError("the invariance claims need the scans of run() (result.scan, .control)")
    return r.scan, r.control


def _distinct_applies(r: Result) -> str | None:
    if r.n_pairs_distinct == 0:
        return (
            f"every prompt starts with the same token (id {r.first_tokens[0]}), so the massive "
            "token's state is the same for every input by construction (paper.md §4); give prompts "
            "with different first tokens (e.g. --bos no)"
        )
    return None


def _cross(r: Result, mats: np.ndarray, reduce: Callable[[np.ndarray], Any]) -> claims.Sample:
    scan, _ = _scans(r)
    return claims.pair_measure(mats, scan.pair_array(False), reduce)


def _state(r: Result) -> claims.Sample:
    return _cross(r, _scans(r)[0].cos_matrices().numpy()[r.me_layer :], claims.lowest)


def _beyond(r: Result) -> claims.Sample:
    scan, _ = _scans(r)
    gap = scan.cos_matrices().numpy() - scan.others_cos_matrices().numpy()
    return _cross(r, gap[r.me_layer :], claims.lowest)


def _key_applies(r: Result) -> str | None:
    if r.me_layer == len(r.layers) - 1:
        return "the ME layer is the last layer: no key reads its output"
    return _distinct_applies(r)


def _key(r: Result) -> claims.Sample:
    km = _scans(r)[0].key_cos_matrices().numpy()[r.me_layer + 1 :]
    return _cross(r, km.reshape(-1, *km.shape[-2:]), claims.lowest)


def _created_applies(r: Result) -> str | None:
    if r.me_layer == 0:
        return "the ME layer is layer 0: no layer before it"
    return _distinct_applies(r)


def _created(r: Result) -> claims.Sample:
    me = r.me_layer
    return _cross(r, _scans(r)[0].cos_matrices().numpy(), lambda x: removed_misalignment(x, me))


def _control(r: Result) -> claims.Sample:
    _, ctrl = _scans(r)
    return claims.pair_measure(
        ctrl.cos_matrices().numpy()[r.me_layer :],
        ctrl.pair_array(True),
        claims.lowest,
        r.control_keys,
    )


def _span(xs: Sequence[float], me: int) -> str:
    return f"{min(xs[me:]):.4g} to {max(xs[me:]):.4g} at layers ≥ {me}"


def _control_text(r: Result) -> str:
    return f"control (first token made identical): per-layer cosine {_span([x.cos_across_inputs_control for x in r.layers], r.me_layer)}"


def _state_details(r: Result) -> str:
    return (
        f"ME layer {r.me_text()}; {r.n_pairs_distinct} pairs with different first tokens; "
        f"per-layer cosine from {_span([x.cos_across_inputs for x in r.layers], r.me_layer)}; {_control_text(r)}"
    )


def _beyond_details(r: Result) -> str:
    return (
        f"ME layer {r.me_text()}; the other tokens' cosine across the same pairs: "
        f"{_span([x.others_cos_across_inputs for x in r.layers], r.me_layer)}"
    )


def _key_details(r: Result) -> str:
    heads = len(r.layers[0].key_cos_across_inputs)
    return (
        f"ME layer {r.me_text()}; layers > ME (a layer's keys are read from its input, before its "
        f"FFN); {heads} key/value heads; {r.n_pairs_distinct} pairs; {_control_text(r)}"
    )


def _created_details(r: Result) -> str:
    cos = np.asarray([x.cos_across_inputs for x in r.layers], dtype=np.float64)
    me = r.me_layer
    return (
        f"ME layer {r.me_text()}; mean cosine before the ME layer {np.nanmean(cos[:me]):.4g} "
        f"(1 − cos {np.nanmean(1 - cos[:me]):.3g}), from it on {np.nanmean(cos[me:]):.4g} "
        f"(1 − cos {np.nanmean(1 - cos[me:]):.3g})"
    )


_CONTROL = (
    "the same prompts with their first token made identical (same_first_token_control), where the "
    "massive token's state is the same for every input by construction when it is the first token"
)
SPECS: tuple[claims.Spec, ...] = (
    claims.Spec(
        "invariance.state",
        "§2.4",
        "After the ME layer the massive token's hidden state points the same way for inputs with "
        "different first tokens",
        statistic="min over layers ≥ ME of the mean cosine of h_m across pairs of inputs with "
        "different first tokens",
        op=">=",
        threshold="invariance_cos",
        control=_CONTROL,
        stat=_state,
        applies=_distinct_applies,
        details=_state_details,
        massive_state=True,  # h_m and k_m are functions of the massive token's prefix
    ),
    claims.Spec(
        "invariance.beyond_others",
        "§2.4",
        "The massive token's invariance is its own, not the anisotropy every token shares",
        statistic="min over layers ≥ ME of (mean cosine of h_m across pairs of inputs with different "
        "first tokens − the other tokens' mean cosine across the same pairs)",
        op=">=",
        threshold="invariance_gap",
        control="the other (non-massive) tokens of the same pairs of inputs",
        stat=_beyond,
        applies=_distinct_applies,
        details=_beyond_details,
        massive_state=True,  # h_m and k_m are functions of the massive token's prefix
    ),
    claims.Spec(
        "invariance.key",
        "§2.4",
        "After the ME layer the massive token's key k_m points the same way for every input, in every "
        "key/value head (a fixed reference for attention)",
        statistic="min over layers > ME (the keys are read from the layer's input) and key/value "
        "heads of the mean cosine of k_m (pre-RoPE) across pairs of inputs with different first "
        "tokens",
        op=">=",
        threshold="invariance_cos",
        control=_CONTROL,
        stat=_key,
        applies=_key_applies,
        details=_key_details,
        massive_state=True,  # h_m and k_m are functions of the massive token's prefix
    ),
    claims.Spec(
        "invariance.created_at_me",
        "§2.4",
        "The invariance appears at the ME layer: the massive token's state is more input-independent "
        "after it than before",
        statistic="1 − mean over layers ≥ ME of (1 − cos) / mean over layers < ME of (1 − cos), "
        "cos = the cross-input cosine of h_m (pairs with different first tokens): the fraction of "
        "the remaining non-alignment removed from the ME layer on",
        op=">=",
        threshold="relative_drop",
        control="the layers before the ME layer",
        stat=_created,
        applies=_created_applies,
        details=_created_details,
        massive_state=True,  # h_m and k_m are functions of the massive token's prefix
    ),
    claims.Spec(
        "invariance.control",
        "§4 (trap)",
        "Control: with the first token made identical across inputs, the massive token's state is the "
        "same for every input (true by construction when the massive token is the first token: then "
        "one measurement, not decided)",
        statistic="min over layers ≥ ME of the mean cosine of h_m across inputs of the control batch",
        op=">=",
        threshold="invariance_cos",
        control="—",
        kind="control",
        stat=_control,
        details=lambda r: f"ME layer {r.me_text()}; every pair of the {r.n_prompts} control inputs",
    ),
)


def figures(result: Result) -> dict[str, go.Figure]:
    me, rows = result.me_layer, result.layers
    kd = [r.key_cos_across_inputs for r in rows]
    return {
        "cos_across_inputs": plotting.layer_lines(
            {
                f"different first tokens ({result.n_pairs_distinct} pairs)": [
                    r.cos_across_inputs for r in rows
                ],
                "control: first token made identical": [r.cos_across_inputs_control for r in rows],
                "baseline: the other tokens, same pairs": [
                    r.others_cos_across_inputs for r in rows
                ],
            },
            "Cosine of the massive token's layer output across inputs (mean over pairs)",
            "cosine (1 = same direction)",
            me,
        ),
        "key_cos_across_inputs": plotting.layer_lines(
            {f"kv head {h}": [row[h] for row in kd] for h in range(len(kd[0]) if kd else 0)},
            "Cosine of the massive token's key k_m across inputs with different first tokens, "
            "per key/value head",
            "cosine (1 = same direction)",
            me,
        ),
        "cos_across_layers": plotting.layer_layer_heatmap(
            result.cos_across_layers,
            "Cosine of the massive token's state between layers (mean over prompts)"
            + (f"; ME layer {me} (1-based {me + 1})" if me is not None else ""),
        ),
        "norm_stability": plotting.layer_lines(
            {"std / mean of ‖h_m‖ across inputs": [r.norm_cv for r in rows]},
            "Norm stability of the massive token across inputs (coefficient of variation)",
            "coefficient of variation (dimensionless)",
            me,
        ),
    }


def summary(result: Result) -> str:
    return result.layer_table(
        [
            f"pairs with different first tokens: {result.n_pairs_distinct}",
            f"ME layer: {result.me_text()}",
        ],
        ["cos inputs", "control", "min key cos", "cos next", "norm CV"],
        lambda r: (
            r.cos_across_inputs,
            r.cos_across_inputs_control,
            min(r.key_cos_across_inputs),
            r.cos_next_layer,
            r.norm_cv,
        ),
    )


EXPERIMENT = Experiment(
    NAME,
    Config,
    run,
    SPECS,
    figures,
    summary,
    __doc__,
    key_figures=("cos_across_inputs",),
    inputs=inputs,
)
main = command(EXPERIMENT)


if __name__ == "__main__":
    raise SystemExit(main())
