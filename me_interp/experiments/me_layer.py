"""ME-layer report: where are massive activations born, in which dims and positions, by which sub-layer?

Runs the prompts once (``probes.batching``), records token norms at every site of every layer
(``probes.norms``), detects massive activations over all positions (``probes.massive``) and
localises the ME layer and every emergence event. Figures: the Figure-1 view (massive-token norm vs
the others at each site; on a sandwich-norm model also at the sub-layers' own outputs before their
post-norms), a token × dimension view of the ME layer's output, and the two ratios per layer
(docs/me_layer.md).

A model without a massive activation is a result, not an error: ``sudden_birth`` fails there.

    python -m me_interp.experiments.me_layer                # bundled model, built-in prompts
    python -m me_interp.experiments.me_layer --model Qwen/Qwen3-4B --device cuda --criterion either
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from me_interp import claims, names, plotting
from me_interp.loading.loaded import LoadedModel
from me_interp.probes.massive import (
    EVENT_COLUMNS,
    Criterion,
    MELocation,
    massive_tokens,
    site_text,
)
from me_interp.probes.norms import ratio_to_others, reference_medians, scan_norms, top_ratio
from me_interp.probes.site import Site, Units, no_massive_why
from me_interp.study import (
    BackendConfig,
    CriterionConfig,
    Experiment,
    Headed,
    Inputs,
    RunHeader,
    checked,
    command,
    prepare,
    run_header,
)
from me_interp.study.layer_report import peak_details, peak_measure, unit_curves
from me_interp.terminal import fmt_table

NAME = "me_layer"


@dataclass(frozen=True)
class Config(CriterionConfig, BackendConfig):
    """ME-layer scan settings (see ``probes.massive`` for the criterion).

    Attributes:
        abs_threshold: ``sun`` criterion: a value is massive when ``|a|`` exceeds this absolute
            threshold (and the relative one).
        rel_threshold: ``sun`` criterion: ... and ``|a|`` is at least this many times the median
            ``|a|`` of the layer output.
        norm_ratio: ``norm`` criterion: a token is massive when its layer-output norm is at least this
            many times the median norm of the other tokens.
        min_prompt_fraction: a layer counts as massive when at least this fraction of the prompts has
            a massive token there, in (0, 1].
        top_k: how many of each token's largest ``|a|`` values the scan keeps per site (>= 1).
    """

    abs_threshold: float = checked(100.0, ge=0)
    rel_threshold: float = checked(1000.0, ge=1)  # ratios to a median: below 1 every token passes
    norm_ratio: float = checked(50.0, ge=1)
    min_prompt_fraction: float = checked(0.5, gt=0, le=1)
    top_k: int = checked(16, ge=1)

    def detection(self) -> Criterion:
        return Criterion(
            kind=self.criterion,  # type: ignore[arg-type]
            abs_threshold=self.abs_threshold,
            rel_threshold=self.rel_threshold,
            norm_ratio=self.norm_ratio,
            min_prompt_fraction=self.min_prompt_fraction,
        )


@dataclass(frozen=True)
class SiteNorms:
    """Per layer, the median over prompts of the reference token's norm (``massive``) and of the
    other tokens' mean norm (``others``) at one site."""

    massive: list[float]
    others: list[float]


@dataclass(frozen=True)
class PerPrompt:
    """The ``[prompt][layer]`` arrays behind the claims: ``r_pre``, ``r_mid``, ``r_post`` (the
    position-agnostic norm ratio ``R`` at the block input, after attention and at the layer output),
    ``ref_ratio`` (the reference token's layer-output norm over the mean of the others') and
    ``massive`` (1 where the prompt has a massive token at that layer's output) and ``ref_norm``
    (the reference token's layer-output norm)."""

    r_pre: list[list[float]]
    r_mid: list[list[float]]
    r_post: list[list[float]]
    ref_ratio: list[list[float]]
    massive: list[list[float]]
    ref_norm: list[list[float]] = field(default_factory=list)  # empty in older results

    def array(self, key: str) -> np.ndarray:
        """One of the arrays as a ``[prompt, layer]`` float array."""
        return np.asarray(getattr(self, key), dtype=np.float64)


@dataclass(frozen=True)
class Result(Headed):
    """What :func:`run` measured: the run header (with the Site: the detected ME layer, its dims and
    position), the ME-layer location (every event, the per-layer ratios of every site in
    ``location.site_ratios``), the Figure-1 norms per site, the heatmap of prompt 0, and the
    per-prompt arrays behind the claims."""

    header: RunHeader
    bos_prepended: bool
    location: MELocation
    site_norms: dict[str, SiteNorms]
    heatmap_tokens: list[str]
    heatmap_values: list[list[float]]
    heatmap_layer: int
    prompt_lengths: list[int]
    per_prompt: PerPrompt
    units: Units | None

    @property
    def me_layer(self) -> int | None:
        return self.location.me_layer

    @property
    def me_site(self) -> str | None:
        """The sub-layer that creates the massive activation at the ME layer."""
        ev = self.location.me_event
        return None if ev is None else ev.site

    def array(self, key: str) -> np.ndarray:
        """``per_prompt.<key>`` as a ``[prompt, layer]`` float array."""
        return self.per_prompt.array(key)

    def log_jumps(self) -> np.ndarray:
        """``[prompt, layer]`` ``log(R_l / R_{l-1})`` of the layer output (``R_{-1}`` = block 0 input)."""
        post = self.array("r_post")
        before = np.concatenate([self.array("r_pre")[:, :1], post[:, :-1]], axis=1)
        return np.log(post / before)

    def judged_layer(self) -> int:
        """The ME layer, or (without one) the layer with the largest median jump."""
        if self.me_layer is not None:
            return self.me_layer
        return int(np.argmax(np.median(self.log_jumps(), axis=0)))

    def selected_jump_layer(self) -> int:
        """The layer of the largest mean log jump over the selection half of :attr:`units` (all
        prompts when nothing can be held out): the layer ``one_layer`` tests on the other half."""
        units = self.units
        rows = units.prompts(units.select) if units is not None else range(self.n_prompts)
        return int(np.argmax(self.log_jumps()[list(rows)].mean(0)))


def inputs(cfg: Config, model: LoadedModel) -> Inputs:
    """The prompts and their norm scan (chunked; with sandwich norms, Gemma 2/3, the sub-layers'
    own outputs too, before their post-norms); ``made``: the number of prompts given."""
    prompts = cfg.load_prompts()
    batch = model.tokenize(prompts)
    sites = (*names.SITES, *model.arch.own_sites())
    scan = scan_norms(model, batch, sites, top_k=cfg.top_k, keep_prompt=0)  # chunked
    return Inputs(batch, scan, made=(len(prompts),))


def run(cfg: Config, model: LoadedModel | None = None, site: Site | None = None) -> Result:
    """Scan the prompts and localise the ME layer. No printing, no files.

    A model without a massive activation is a result (``me_layer`` None; the existence claim fails),
    not an error.
    """
    model, site = prepare(EXPERIMENT, cfg, model, site)
    batch, scan, (n_prompts,) = site.batch, site.scan, site.inputs.made
    crit = cfg.detection()
    loc = site.location
    ref = torch.as_tensor(loc.reference_positions)
    per_prompt = PerPrompt(
        *(
            top_ratio(scan.site_norms(f"resid_{s}"), scan.mask).T.tolist()
            for s in ("pre", "mid", "post")
        ),
        ref_ratio=ratio_to_others(scan.site_norms("resid_post"), scan.mask, ref).T.tolist(),
        massive=massive_tokens(scan, crit).any(-1).T.float().tolist(),
        ref_norm=scan.site_norms("resid_post")[:, torch.arange(len(ref)), ref].T.tolist(),
    )
    layer = loc.me_layer if loc.me_layer is not None else int(torch.tensor(loc.top_ratio).argmax())
    return Result(
        header=run_header(cfg, model, n_prompts, site),
        bos_prepended=model.bos_prepended(batch),
        location=loc,
        site_norms={
            s: SiteNorms(*v) for s, v in reference_medians(scan, loc.reference_positions).items()
        },
        heatmap_tokens=model.token_texts(batch),
        heatmap_values=scan.kept_resid[layer].tolist(),
        heatmap_layer=layer,
        prompt_lengths=list(batch.lengths),
        per_prompt=per_prompt,
        units=site.units,
    )


def figures(result: Result) -> dict[str, Any]:
    loc, layer = result.location, result.heatmap_layer
    what = (
        "ME layer"
        if loc.me_layer is not None
        else "layer with the largest norm ratio (no ME layer)"
    )
    return {
        "norms_by_site": plotting.site_norms_figure(
            {s: vars(n) for s, n in result.site_norms.items()}, loc.me_layer, result.model
        ),
        "me_layer_tokens_by_dim": plotting.token_dim_heatmap(
            result.heatmap_values,
            result.heatmap_tokens,
            f"|layer output| of prompt 0 at the {what} {layer} (1-based {layer + 1})",
        ),
        "ratios": plotting.layer_lines(
            {
                "max token / mean of others (layer output)": loc.top_ratio,
                "max |a| / median |a| (layer output)": loc.max_over_median,
            },
            "Massive-activation ratios per layer (median over prompts)",
            "ratio",
            loc.me_layer,
            log_y=True,
        ),
    }


def summary(result: Result) -> str:
    loc = result.location
    lines = [
        f"model: {result.model}   bos: {result.header.bos} (BOS prepended: {result.bos_prepended})   "
        f"prompts: {result.n_prompts}",
    ]
    if loc.me_layer is None:
        lines.append("ME layer: none found (no layer output meets the massive criterion)")
    else:
        ev = loc.me_event
        lines.append(
            f"ME layer: {loc.me_layer} (0-based) = {loc.me_layer + 1} (1-based); created by "
            f"{site_text(ev.site)}; jump x{ev.jump:.3g}; dims {loc.massive_dims[:8]}; positions "
            f"{sorted({p for ps in loc.massive_positions for p in ps})}"
        )
    if loc.events:
        lines += ["", fmt_table(EVENT_COLUMNS, [e.cells() for e in loc.events])]
    return "\n".join(lines)


def _where(result: Result) -> str:
    loc = result.location
    ev = loc.me_event
    if ev is None:
        L = result.judged_layer()
        jump = float(np.median(np.exp(result.log_jumps()[:, L])))
        return (
            f"{no_massive_why(loc, result.n_prompts)}; judged at the largest jump, layer {L} "
            f"(median R_L / R_(L-1) = {jump:.3g})"
        )
    return (
        f"ME layer {ev.layer} (1-based {ev.layer + 1}); {len(loc.events)} emergence event(s) at "
        f"layers {[e.layer for e in loc.events]}; massive dims {loc.massive_dims[:4]}"
    )


def _needs_me_layer(result: Result) -> str | None:
    if result.me_layer is None:
        return no_massive_why(result.location, result.n_prompts)
    return None


def _birth(result: Result, layer: int | None = None) -> claims.Sample:
    layer = result.judged_layer() if layer is None else layer
    return claims.Sample(np.exp(result.log_jumps()[:, layer]), np.median)


def _layers(result: Result) -> range:
    return range(len(result.location.top_ratio))


def _birth_details(result: Result) -> str:
    L = result.judged_layer()
    n = int((result.array("massive")[:, L] > 0).sum())
    return f"{_where(result)}; {n} of {result.n_prompts} prompts have a massive token at layer {L}"


def _one_layer(result: Result) -> claims.Outcomes:
    """Per held-out unit: its largest jump is at the selected layer *and* no other layer's jump
    reaches ``jump`` (a birth split over two layers is not one layer)."""
    logj, layer, units = result.log_jumps(), result.selected_jump_layer(), result.units
    peak = peak_measure(logj, layer, units, False)
    others = {units.label(u): np.delete(c, layer) for u, c in enumerate(unit_curves(logj, units))}
    alone = [bool(np.nanmax(others[k]) < np.log(claims.threshold("jump"))) for k in peak.labels]
    out = [bool(a and b) for a, b in zip(peak.outcomes, alone, strict=True)]
    return claims.Outcomes(out, peak.labels, unit=peak.unit)


def _one_layer_details(result: Result) -> str:
    logj = result.log_jumps()
    means = logj.mean(0)
    me = result.me_layer
    others = np.delete(means, me)
    second = int(np.argmax(np.where(np.arange(len(means)) == me, -np.inf, means)))
    growth = float(np.clip(means, 0, None).sum())
    share = f"{means[me] / growth:.3g}" if growth > 0 else "undefined (no layer grows it)"
    return (
        f"{_where(result)}; "
        + peak_details(logj, result.selected_jump_layer(), result.units, False, str(me))
        + f"; mean log jump at the ME layer {means[me]:.3g}, other layers {others.mean():.3g} "
        f"± {others.std(ddof=1):.3g}; the largest other jump is at layer {second} "
        f"(×{np.exp(means[second]):.3g}, 'jump' = {claims.threshold('jump'):g}); the ME layer's "
        f"share of the total log growth {share}"
    )


def _ffn_applies(result: Result) -> str | None:
    why = _needs_me_layer(result)
    if why is None and result.location.me_event.site == "unknown":
        return (
            f"{_where(result)}; the sub-layer that creates it is unknown: the scan did not record "
            "the block input and the attention output (resid_pre, resid_mid)"
        )
    return why


def _factors(result: Result, layer: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per prompt, the FFN's factor ``R_post / R_mid`` and the attention's ``R_mid / R_pre`` at the
    ME layer (or ``layer``)."""
    layer = result.me_layer if layer is None else layer
    r_pre, r_mid, r_post = (result.array(k)[:, layer] for k in ("r_pre", "r_mid", "r_post"))
    return r_post / r_mid, r_mid / r_pre


def _ffn_creates(result: Result, layer: int | None = None) -> claims.Sample:
    ffn, attn = _factors(result, layer)
    return claims.Sample(ffn / np.maximum(attn, 1.0), np.median)


def _ffn_details(result: Result) -> str:
    ffn, attn = _factors(result)
    return (
        f"{_where(result)}; at the ME layer the FFN's factor R_post / R_mid has median "
        f"{np.median(ffn):.3g}, the attention's R_mid / R_pre {np.median(attn):.3g}; detected "
        f"site: {result.location.me_event.site}"
    )


def _eraser(result: Result, norm: np.ndarray) -> int | None:
    """The first layer after the ME layer whose signed log change of the massive token's median
    norm is below ``log(carried_fraction)`` (an eraser), else ``None`` (a gradual decay is judged)."""
    me = result.me_layer
    step = np.diff(np.log(np.median(norm, axis=0)))[me:]  # step[i]: layer me + 1 + i
    hit = np.flatnonzero(step < np.log(claims.threshold("carried_fraction")))
    return None if len(hit) == 0 else me + 1 + int(hit[0])


def _carried_rows(result: Result) -> tuple[np.ndarray, np.ndarray, int]:
    """The massive token's layer-output norm per prompt (with a massive token at the ME layer),
    its per-prompt ``min_{ME < l < E} ‖h_l‖ / ‖h_ME‖`` over the middle layers (E: the eraser,
    else past the last layer), and E."""
    me = result.me_layer
    norm = result.array("ref_norm")[result.array("massive")[:, me] > 0]  # massive token at ME
    # an eraser right after the ME layer leaves no middle layers: that layer is judged (not carried)
    end = max(_eraser(result, norm) or norm.shape[1], me + 2)
    return norm, (norm[:, me + 1 : end] / norm[:, me : me + 1]).min(axis=1), end


def _carried_applies(result: Result) -> str | None:
    why = _needs_me_layer(result)
    if why is None and result.me_layer == len(result.location.top_ratio) - 1:
        return "the ME layer is the last layer: nothing carries it on"
    return why


def _carried(result: Result) -> claims.Sample:
    me = result.me_layer
    rows = np.flatnonzero(result.array("massive")[:, me] > 0)
    return claims.Sample(_carried_rows(result)[1], prompts=rows.tolist())


def _carried_details(result: Result) -> str:
    norm, _, end = _carried_rows(result)
    ev, me = result.location.me_event, result.me_layer
    med = np.median(norm, axis=0)
    rho = np.median(result.array("ref_ratio")[result.array("massive")[:, me] > 0], axis=0)
    erased = (
        f"erasure (descriptive, not judged): layer {end} multiplies the median norm by "
        f"{med[end] / med[end - 1]:.3g} ({med[end - 1]:.4g} → {med[end]:.4g}), "
        f"{med[-1]:.4g} at the last layer"
        if end < norm.shape[1] and med[end] < med[end - 1] * claims.threshold("carried_fraction")
        else "no later layer erases it (no single-layer drop below 'carried_fraction')"
    )
    return (
        f"{_where(result)}; judged over layers {me + 1}–{end - 1}; the event lasts to layer "
        f"{ev.last_layer} ({'to the end' if ev.persists_to_end else 'ends before the last layer'}); "
        f"median norm at the ME layer {med[me]:.4g}, at layer {end - 1} {med[end - 1]:.4g} (its "
        f"ratio to the other tokens' mean {rho[me]:.3g} → {rho[end - 1]:.3g}); " + erased
    )


SPECS: tuple[claims.Spec, ...] = (
    claims.Spec(
        "me_layer.sudden_birth",
        "§2.1",
        "Massive activations are born suddenly, in one layer (the ME layer)",
        statistic="median over prompts of the birth jump R_L / R_{L-1} at the ME layer L, with "
        "R = max_t ‖h_t‖ / mean_{t≠argmax} ‖h_t‖ of the layer output (without an ME layer, L is the "
        "layer with the largest median jump)",
        op=">=",
        threshold="jump",
        control="a model without a massive activation (the unplanted twin, a random model): no "
        "layer makes one token's norm jump, the statistic is about 1 and the claim fails",
        stat=_birth,
        details=_birth_details,
        placebo=claims.placebo_of(_birth, Result.judged_layer, _layers),
    ),
    claims.Spec(
        "me_layer.one_layer",
        "§2.1",
        "The birth is confined to one layer: the layer of the largest jump, chosen on other "
        "prompts, is the largest jump of each held-out prompt, and no other layer's jump reaches "
        "the 'jump' threshold",
        statistic="fraction of the held-out prompts (one per distinct massive-token prefix) whose "
        "largest log jump log(R_l / R_{l-1}) is at the layer of the largest mean log jump of the "
        "selection half while every other layer's jump stays below 'jump'",
        op=">=",
        threshold="peak_fraction",
        control="the jumps of every other layer, including precursor events and a second birth "
        "layer (chance 1 / L under exchangeable layers)",
        unit="held-out prompts",
        stat=_one_layer,
        applies=_needs_me_layer,
        details=_one_layer_details,
    ),
    claims.Spec(
        "me_layer.ffn_creates",
        "§2.1",
        "The ME layer's FFN, not its attention, creates the massive activation: the FFN multiplies "
        "the norm ratio by a large factor, also relative to what the attention before it did",
        statistic="median over prompts of the FFN's factor R_post / R_mid at the ME layer over the "
        "attention's factor R_mid / R_pre where that exceeds 1 (R_post / R_mid / max(1, "
        "R_mid / R_pre))",
        op=">=",
        threshold="jump",
        control="the attention's factor R_mid / R_pre at the same layer (in the rule, and in the "
        "details)",
        stat=_ffn_creates,
        applies=_ffn_applies,
        details=_ffn_details,
        placebo=claims.placebo_of(_ffn_creates, lambda r: r.me_layer, _layers),
    ),
    claims.Spec(
        "me_layer.carried",
        "§2.1",
        "The residual stream then carries the massive activation through the middle layers, from "
        "the ME layer to the layer that erases it (or to the last layer)",
        statistic="mean over the prompts with a massive token at the ME layer L of "
        "min_{L < l < E} ‖h_l‖ / ‖h_L‖, with h the massive token's layer output and E the first "
        "layer after L whose signed log change of the median ‖h‖ falls below "
        "log('carried_fraction') (an eraser; none: E = the number of layers)",
        op=">=",
        threshold="carried_fraction",
        control="a gradual decay over the middle layers (no single-layer eraser) pulls the minimum "
        "down; the erasure itself is reported in the details, not judged",
        unit="prompts with a massive token at the ME layer",
        stat=_carried,
        applies=_carried_applies,
        details=_carried_details,
        massive_state=True,  # its norm depends on its prefix only
    ),
)


# attention="sdpa": it reads no attention pattern (the fused kernel, me_interp.loading.attention)
EXPERIMENT = Experiment(
    NAME,
    Config,
    run,
    SPECS,
    figures,
    summary,
    __doc__,
    attention="sdpa",
    key_figures=("ratios",),
    inputs=inputs,
)
main = command(EXPERIMENT)


if __name__ == "__main__":
    raise SystemExit(main())
