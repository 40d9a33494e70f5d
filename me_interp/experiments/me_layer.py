"""ME-layer report: where are massive activations born, in which dims and positions, by which sub-layer?

Runs the prompts once (``probes.batching``: length-sorted chunks, no logits), records token norms at
every site of every layer (``probes.norms``), detects massive activations over all positions
(``probes.massive``) and localises the ME layer and every emergence event (0-based and 1-based).
Writes ``result.json`` with ``model``, ``bos``, ``me_layer``, ``me_layer_1based``, ``events``,
``massive_positions``, ``massive_dims``, per-layer ``resid_norm_ratio``, ``ffn_out_norm_ratio``,
``max_over_median``, the per-prompt ratios behind the claims (``per_prompt``) and the claims
(``claims``, see :data:`SPECS`); and three figures: the Figure-1 view (massive-token norm vs the others
at each site; on a sandwich-norm model, Gemma 2/3, also at the attention's and the FFN's own outputs
before their post-norms, ``attn_own`` / ``ffn_own``, beside their residual contributions), a token ×
dimension view of the ME layer's output, and the two ratios per layer.

Claims (paper.md §2.1; thresholds from ``claims.THRESHOLDS``, intervals bootstrapped over prompts):
``me_layer.sudden_birth`` (the existence claim: it *fails* on a model without a massive activation),
``me_layer.one_layer`` (against the null of every other layer), ``me_layer.ffn_creates`` and
``me_layer.carried`` (not applicable without an ME layer; ``ffn_creates`` also when the ME event's
site is ``"unknown"``, a scan without ``resid_pre``/``resid_mid``).

    python -m me_interp.experiments.me_layer                # bundled model, built-in prompts
    python -m me_interp.experiments.me_layer --model Qwen/Qwen3-4B --device cuda --criterion either
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from me_interp import claims, names, plotting
from me_interp.architecture import (
    ATTN_OWN_SITE,
    ATTN_RESIDUAL_SITE,
    FFN_OWN_SITE,
    FFN_RESIDUAL_SITE,
)
from me_interp.experiments.common import (
    INDEX_CONVENTION,
    CommonConfig,
    cli_main,
    fmt_table,
    model_for,
)
from me_interp.models import LoadedModel
from me_interp.probes.massive import Criterion, MELocation, locate_me_layer, massive_tokens
from me_interp.probes.norms import NormScan, ratio_to_others, scan_norms, top_ratio

NAME = "me_layer"

SPECS: tuple[claims.Spec, ...] = (
    claims.Spec(
        "me_layer.sudden_birth",
        "§2.1",
        "Massive activations are born suddenly, in one layer (the ME layer)",
        statistic="median over prompts of the birth jump R_L / R_{L-1} at the ME layer L, with "
        "R = max_t ‖h_t‖ / mean_{t≠argmax} ‖h_t‖ of the layer output, counted 0 for a prompt with no "
        "massive token at L (without an ME layer, L is the layer with the largest median jump)",
        op=">=",
        threshold="jump",
        control="a model without a massive activation (the unplanted twin, a random model): no prompt "
        "has a massive token, the statistic is 0 and the claim fails",
    ),
    claims.Spec(
        "me_layer.one_layer",
        "§2.1",
        "The birth is confined to the ME layer: its jump stands out from every other layer's "
        "(judged against the null of the other layers, since the ME layer is chosen as the largest "
        "jump)",
        statistic="z of the ME layer's mean log jump log(R_L / R_{L-1}) against the other layers' "
        "(claims.null_z), bootstrapped over prompts",
        op=">=",
        threshold="null_z",
        control="the jumps of every other layer, including precursor events",
    ),
    claims.Spec(
        "me_layer.ffn_creates",
        "§2.1",
        "The ME layer's FFN, not its attention, creates the massive activation",
        statistic="median over prompts of the FFN's factor R_post / R_mid at the ME layer",
        op=">=",
        threshold="jump",
        control="the attention's factor R_mid / R_pre at the same layer (in the details)",
    ),
    claims.Spec(
        "me_layer.carried",
        "§2.1",
        "The residual stream then carries the massive activation to the last layer",
        statistic="mean over the prompts with a massive token at the ME layer L of "
        "min_{l ≥ L} ρ_l / ρ_L, with ρ = the massive token's layer-output norm over the mean of the "
        "others'",
        op=">=",
        threshold="carried_fraction",
        control="layers where the model removes the massive activation (the event ends) pull the "
        "minimum down",
    ),
)
SUDDEN, ONE_LAYER, FFN_CREATES, CARRIED = SPECS


@dataclass(frozen=True)
class Config(CommonConfig):
    """ME-layer scan settings (see ``probes.massive`` for the criterion).

    Attributes:
        criterion: massive-activation criterion: ``sun`` (value thresholds), ``norm`` (token-norm
            ratio), ``either`` or ``both``.
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

    criterion: str = "sun"
    abs_threshold: float = 100.0
    rel_threshold: float = 1000.0
    norm_ratio: float = 50.0
    min_prompt_fraction: float = 0.5
    top_k: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        self.detection()  # validates
        if self.top_k < 1:
            raise ValueError("top_k must be >= 1")

    def detection(self) -> Criterion:
        return Criterion(
            kind=self.criterion,  # type: ignore[arg-type]
            abs_threshold=self.abs_threshold,
            rel_threshold=self.rel_threshold,
            norm_ratio=self.norm_ratio,
            min_prompt_fraction=self.min_prompt_fraction,
        )


@dataclass
class Result:
    """What :func:`run` measured.

    ``per_prompt`` holds ``[prompt][layer]`` arrays behind the claims: ``r_pre``, ``r_mid``,
    ``r_post`` (the position-agnostic norm ratio ``R`` at the block input, after attention and at the
    layer output), ``ref_ratio`` (the reference token's layer-output norm over the mean of the
    others') and ``massive`` (whether the prompt has a massive token at that layer's output).
    """

    model: str
    bos: str
    bos_prepended: bool
    n_prompts: int
    location: MELocation
    site_norms: dict[str, dict[str, list[float]]]
    heatmap_tokens: list[str]
    heatmap_values: list[list[float]]
    heatmap_layer: int
    prompt_lengths: list[int] = field(default_factory=list)
    per_prompt: dict[str, list[list[float]]] = field(default_factory=dict)
    seed: int = 0

    @property
    def me_layer(self) -> int | None:
        return self.location.me_layer

    def array(self, key: str) -> np.ndarray:
        """``per_prompt[key]`` as a ``[prompt, layer]`` float array."""
        return np.asarray(self.per_prompt[key], dtype=np.float64)

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

    def to_dict(self) -> dict[str, Any]:
        loc = self.location
        ratios = loc.site_ratios
        n = len(loc.top_ratio)
        return {
            "model": self.model,
            "bos": self.bos,
            "bos_prepended": self.bos_prepended,
            "index_convention": INDEX_CONVENTION,
            "me_layer": loc.me_layer,
            "me_layer_1based": loc.me_layer_1based,
            "me_site": loc.me_event.site if loc.me_event else None,
            "judged_layer": self.judged_layer(),
            "events": [e.to_dict() for e in loc.events],
            "massive_positions": loc.massive_positions,
            "massive_dims": loc.massive_dims,
            "reference_positions": loc.reference_positions,
            "criterion": loc.criterion.to_dict(),
            "n_prompts": self.n_prompts,
            "prompt_lengths": self.prompt_lengths,
            "layers": [
                {
                    "layer": i,
                    "layer_1based": i + 1,
                    "resid_norm_ratio": ratios["resid_post"][i],
                    "ffn_out_norm_ratio": ratios["ffn_out"][i],
                    "ffn_in_norm_ratio": ratios["ffn_in"][i],
                    "attn_out_norm_ratio": ratios["attn_out"][i],
                    "attn_in_norm_ratio": ratios["attn_in"][i],
                    **{
                        f"{s}_norm_ratio": ratios[s][i]
                        for s in names.OWN_SITES
                        if s in ratios  # sandwich norms: the sub-layer's own output as well
                    },
                    "top_norm_ratio": loc.top_ratio[i],
                    "max_over_median": loc.max_over_median[i],
                    "has_massive": loc.layer_has_massive[i],
                    "prompt_fraction": loc.prompt_fraction[i],
                }
                for i in range(n)
            ],
            "site_norms": self.site_norms,
            "per_prompt": self.per_prompt,
        }


def _site_norms(scan: NormScan, reference: Sequence[int]) -> dict[str, dict[str, list[float]]]:
    """Median over prompts of the reference token's norm and of the other tokens' mean norm."""
    ref = torch.as_tensor(list(reference))
    idx = torch.arange(len(ref))
    others = scan.mask.clone()
    others[idx, ref] = False
    out = {}
    for s in scan.sites:
        n = scan.site_norms(s)  # [layer batch pos]
        mass = n[:, idx, ref]
        other = torch.where(others, n, torch.zeros(())).sum(-1) / others.sum(-1).clamp(min=1)
        out[s] = {
            "massive": mass.median(-1).values.tolist(),
            "others": other.median(-1).values.tolist(),
        }
    return out


def run(cfg: Config, model: LoadedModel | None = None) -> Result:
    """Scan the prompts and localise the ME layer. No printing, no files.

    A model without a massive activation is a result (``me_layer`` None; the existence claim fails),
    not an error.
    """
    model = model_for(cfg, model)
    prompts = cfg.load_prompts()
    batch = model.tokenize(prompts)
    # sandwich norms (Gemma 2/3): the sub-layers' own outputs too, before their post-norms
    sites = (*names.SITES, *model.arch.own_sites())
    scan = scan_norms(model, batch, sites, top_k=cfg.top_k, keep_prompt=0)  # chunked
    crit = cfg.detection()
    loc = locate_me_layer(scan, crit)
    ref = torch.as_tensor(loc.reference_positions)
    per_prompt = {
        f"r_{s}": top_ratio(scan.site_norms(f"resid_{s}"), scan.mask).T.tolist()
        for s in ("pre", "mid", "post")
    }
    per_prompt["ref_ratio"] = ratio_to_others(
        scan.site_norms("resid_post"), scan.mask, ref
    ).T.tolist()
    per_prompt["massive"] = massive_tokens(scan, crit).any(-1).T.float().tolist()
    layer = loc.me_layer if loc.me_layer is not None else int(torch.tensor(loc.top_ratio).argmax())
    n0 = batch.lengths[0]
    tokens = [model.tokenizer.decode([int(t)]) for t in batch.tokens[0, :n0]]
    result = Result(
        model=model.name,
        bos=model.bos,
        bos_prepended=model.bos_prepended(batch),
        n_prompts=len(prompts),
        location=loc,
        site_norms=_site_norms(scan, loc.reference_positions),
        heatmap_tokens=tokens,
        heatmap_values=scan.kept_resid[layer].tolist(),
        heatmap_layer=layer,
        prompt_lengths=batch.lengths,
        per_prompt=per_prompt,
        seed=cfg.seed,
    )
    return result


#: The sites of the Figure-1 view (``norms_by_site``), in forward order.
FIGURE_SITES = ("attn_in", "attn_out", "ffn_in", "ffn_out", "resid_post")
#: The sub-layer's own output drawn just before its residual contribution, where the scan recorded
#: it (sandwich norms: ``Architecture.own_sites()``; on other blocks the two are one tensor).
_OWN_BEFORE = {ATTN_RESIDUAL_SITE: ATTN_OWN_SITE, FFN_RESIDUAL_SITE: FFN_OWN_SITE}


def figure_sites(recorded: Sequence[str]) -> list[str]:
    """The panels of ``norms_by_site`` for a scan that recorded the sites ``recorded``:
    :data:`FIGURE_SITES`, with ``attn_own`` / ``ffn_own`` before ``attn_out`` / ``ffn_out`` when
    recorded (so on Gemma 2/3 one row is the attention, one the FFN, one the layer output)."""
    out: list[str] = []
    for s in FIGURE_SITES:
        own = _OWN_BEFORE.get(s)
        if own is not None and own in recorded:
            out.append(own)
        out.append(s)
    return out


def figures(result: Result) -> dict[str, Any]:
    loc = result.location
    sites = figure_sites(list(result.site_norms))
    fig1 = plotting.site_norms_figure(
        {s: result.site_norms[s] for s in sites}, loc.me_layer, result.model
    )
    what = (
        "ME layer"
        if loc.me_layer is not None
        else "layer with the largest norm ratio (no ME layer)"
    )
    heat = plotting.token_dim_heatmap(
        result.heatmap_values,
        result.heatmap_tokens,
        f"|layer output| of prompt 0 at the {what} {result.heatmap_layer} "
        f"(1-based {result.heatmap_layer + 1})",
    )
    ratio = plotting.layer_lines(
        {
            "max token / mean of others (layer output)": loc.top_ratio,
            "max |a| / median |a| (layer output)": loc.max_over_median,
        },
        "Massive-activation ratios per layer (median over prompts)",
        "ratio",
        loc.me_layer,
        log_y=True,
    )
    return {"norms_by_site": fig1, "me_layer_tokens_by_dim": heat, "ratios": ratio}


def summary(result: Result) -> str:
    loc = result.location
    lines = [
        f"model: {result.model}   bos: {result.bos} (BOS prepended: {result.bos_prepended})   "
        f"prompts: {result.n_prompts}",
    ]
    if loc.me_layer is None:
        lines.append("ME layer: none found (no layer output meets the massive criterion)")
    else:
        ev = loc.me_event
        lines.append(
            f"ME layer: {loc.me_layer} (0-based) = {loc.me_layer + 1} (1-based); created by the "
            f"{ev.site}; jump x{ev.jump:.3g}; dims {loc.massive_dims[:8]}; positions "
            f"{sorted({p for ps in loc.massive_positions for p in ps})}"
        )
    rows = [
        (
            e.layer,
            e.layer_1based,
            e.last_layer,
            "yes" if e.persists_to_end else "no",
            e.site,
            e.jump,
            str(e.dims[:4]),
        )
        for e in loc.events
    ]
    if rows:
        lines.append("")
        lines.append(
            fmt_table(["start", "start(1b)", "last", "to end", "site", "jump", "dims"], rows)
        )
    return "\n".join(lines)


def no_massive_why(loc: MELocation, n_prompts: int) -> str:
    """Why the mechanism claims are not applicable on a model without a massive activation."""
    c = loc.criterion
    rule = {
        "sun": f"some |a| > {c.abs_threshold:g} and ≥ {c.rel_threshold:g} × the median |a|",
        "norm": f"a token norm ≥ {c.norm_ratio:g} × the median of the others",
        "either": "the value or the norm criterion",
        "both": "the value and the norm criterion",
    }[c.kind]
    return (
        f"no massive activation on this model: no layer output has a massive token ({c.kind} "
        f"criterion: {rule}) in at least {c.min_prompt_fraction:.0%} of the {n_prompts} prompts"
    )


def _where(result: Result) -> str:
    loc = result.location
    ev = loc.me_event
    if ev is None:
        L = result.judged_layer()
        jump = float(np.median(np.exp(result.log_jumps()[:, L])))
        return (
            f"{no_massive_why(loc, result.n_prompts)}; judged at the largest jump, layer {L} "
            f"(median R_L / R_(L-1) = {jump:.3g} without the massive-token condition)"
        )
    return (
        f"ME layer {ev.layer} (1-based {ev.layer + 1}); {len(loc.events)} emergence event(s) at "
        f"layers {[e.layer for e in loc.events]}; massive dims {loc.massive_dims[:4]}"
    )


def verdicts(result: Result) -> list[claims.Claim]:
    """Claim 1 of the paper (sudden emergence at one layer, by the FFN, carried by the residual
    stream) on this model, with intervals bootstrapped over prompts."""
    L = result.judged_layer()
    seed = result.seed
    jumps = np.exp(result.log_jumps())  # [prompt layer]
    massive = result.array("massive") > 0
    birth = np.where(massive[:, L], jumps[:, L], 0.0)
    out = [
        SUDDEN.judge(
            claims.bootstrap(birth, np.median, seed=seed),
            details=f"{_where(result)}; {int(massive[:, L].sum())} of {len(birth)} prompts have a "
            f"massive token at layer {L}",
        )
    ]
    me = result.me_layer
    if me is None:
        why = no_massive_why(result.location, result.n_prompts)
        return out + [s.not_applicable(why) for s in (ONE_LAYER, FFN_CREATES, CARRIED)]
    logj = result.log_jumps()
    z = claims.bootstrap(logj, lambda a: claims.null_z(a.mean(0).tolist(), me), seed=seed)
    means = logj.mean(0)
    others = np.delete(means, me)
    out.append(
        ONE_LAYER.judge(
            z,
            details=f"{_where(result)}; mean log jump {means[me]:.3g} at the ME layer, other layers "
            f"{others.mean():.3g} ± {others.std(ddof=1):.3g} (largest other: layer "
            f"{int(np.argmax(np.where(np.arange(len(means)) == me, -np.inf, means)))})",
        )
    )
    if result.location.me_event.site == "unknown":
        out.append(
            FFN_CREATES.not_applicable(
                f"{_where(result)}; the sub-layer that creates it is unknown: the scan did not "
                "record the block input and the attention output (resid_pre, resid_mid)"
            )
        )
    else:
        r_pre, r_mid, r_post = (result.array(k)[:, me] for k in ("r_pre", "r_mid", "r_post"))
        out.append(
            FFN_CREATES.judge(
                claims.bootstrap(r_post / r_mid, np.median, seed=seed),
                details=f"{_where(result)}; attention factor R_mid / R_pre at the ME layer: median "
                f"{np.median(r_mid / r_pre):.3g}; detected site: {result.location.me_event.site}",
            )
        )
    n_layers = jumps.shape[1]
    if me == n_layers - 1:
        out.append(CARRIED.not_applicable("the ME layer is the last layer: nothing carries it on"))
        return out
    rho = result.array("ref_ratio")[massive[:, me]]  # prompts with a massive token at ME
    frac = (rho[:, me:] / rho[:, me : me + 1]).min(axis=1)
    ev = result.location.me_event
    out.append(
        CARRIED.judge(
            claims.bootstrap(frac, seed=seed, unit="prompts with a massive token at the ME layer"),
            details=f"{_where(result)}; the event lasts to layer {ev.last_layer} "
            f"({'to the end' if ev.persists_to_end else 'ends before the last layer'}); median ratio "
            f"at the ME layer {np.median(rho[:, me]):.3g}, at the last layer {np.median(rho[:, -1]):.3g}",
        )
    )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    return cli_main(NAME, Config, run, figures, summary, argv, description=__doc__)


if __name__ == "__main__":
    raise SystemExit(main())
