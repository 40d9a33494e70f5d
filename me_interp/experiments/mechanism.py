"""Mechanism report: RMSNorm alignment and FFN concentration per layer, with the ME layer marked.

Tests paper.md §2 claims 2 and 3 on one model: per layer, ``ΔFrac`` and ``ΔKL`` of the pre-FFN RMSNorm
(after the gain, and the standardised pre-gain variant) and of the pre-attention RMSNorm
(``probes.alignment``); ``ΔC`` after the gate, up, gated-product and down projections and the FFN
magnification of the massive token (``probes.ffn``); the top FFN neurons of the ME layer by their share of
the massive token's FFN output; and where the massive dims rank in the gains ``|w|``. The ME layer and
the massive token of each prompt are detected (``probes.massive``), never given (unless ``--layer``).

Cost: one forward over every prompt records the norms (detection), the alignment and the FFN
statistics of every token together (``probes.batching``); a second forward over the prefixes
``x[: m + 1]`` reads the massive token's neuron activations once ``m`` is known.

The ``*_peak`` claims and ``few_neurons`` select on one half of the distinct massive-token prefixes
and test on the other (``study.layer_report``).

    python -m me_interp.experiments.mechanism                      # bundled model, built-in prompts
    python -m me_interp.experiments.mechanism --k-frac 0.05 --neuron-layer 11

``result.json`` keys are documented in docs/probes.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go
import torch

from me_interp import claims, plotting
from me_interp.loading.loaded import LoadedModel
from me_interp.probes.alignment import (
    ALIGN_SITES,
    AlignmentRecorder,
    GainRank,
    gain_alignment,
    massive_dim_gain_ranks,
)
from me_interp.probes.batching import record
from me_interp.probes.ffn import (
    RESIDUAL_STAGE,
    STAGES,
    FFNAtRecorder,
    FFNRecorder,
    Neuron,
    Stages,
    make_scan,
    neuron_contributions,
    top_neurons,
)
from me_interp.probes.site import Site
from me_interp.study import DetectConfig, Experiment, Inputs, checked, command, prepare
from me_interp.study.experiment import scanned_inputs
from me_interp.study.layer_report import LayerReport, as_array, detect
from me_interp.terminal import fmt_table

NAME = "mechanism"
STAGE_LABELS = {
    "input": "FFN input (RMSNorm output)",
    "gate": "after W_gate",
    "up": "after W_up",
    "product": "σ(gate)·up",
    "down": "after W_down (FFN output)",
}
N_TOP = 3
"""The "few" neurons of ``mechanism.few_neurons`` (the top-3 of ``THRESHOLDS['concentration_share']``)."""


# ------------------------------------------------------------------------------------------
# the claims
# ------------------------------------------------------------------------------------------


def _log_magnification(r: Result) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.log10(as_array(r.per_prompt.magnification))


_PEAK_VALUES: dict[str, Callable[[Result], np.ndarray]] = {
    "frac_peak": lambda r: as_array(r.per_prompt.delta_frac),
    "kl_peak": lambda r: -as_array(r.per_prompt.delta_kl),
    "dc_gate_peak": lambda r: as_array(r.per_prompt.delta_c_gate),
    "dc_up_peak": lambda r: as_array(r.per_prompt.delta_c_up),
    "dc_down_peak": lambda r: as_array(r.per_prompt.delta_c_down),
    "magnification_peak": _log_magnification,
}


def _peak_spec(
    short: str, section: str, what: str, statistic: str, implied_by: str | None = None
) -> claims.Spec:
    values = _PEAK_VALUES[short]
    return claims.Spec(
        f"mechanism.{short}",
        section,
        f"{what} peaks at the ME layer (the ME layer chosen on other prompts than those it is "
        "tested on)",
        statistic=f"fraction of the held-out prompts (one per distinct massive-token prefix) whose "
        f"{statistic} is largest at the ME layer detected on the selection half of the prompts "
        "(with --layer: the given layer, every prompt tested)",
        op=">=",
        threshold="peak_fraction",
        control="the same statistic at every other layer (chance 1 / L under exchangeable layers)",
        unit="held-out prompts",
        stat=lambda r: r.peak(values(r)),
        details=lambda r: r.peak_details(values(r)),
        placebo=lambda r: r.peak_placebo(values(r)),
        implied_by=implied_by,
    )


def _frac_rows(r: Result, layer: int | None = None) -> np.ndarray:
    p, layer = r.per_prompt, r.me_layer if layer is None else layer
    cols = (p.frac_massive, p.frac_others, p.frac_massive_pregain, p.frac_others_pregain)
    return np.stack([as_array(c)[:, layer] for c in cols], axis=1)


def _frac(r: Result, layer: int | None = None) -> claims.Sample:
    return claims.Sample(_frac_rows(r, layer), gain_alignment)


def _kl(r: Result, layer: int | None = None) -> claims.Sample:
    layer = r.me_layer if layer is None else layer
    kl = (as_array(r.per_prompt.kl_others)[:, layer], as_array(r.per_prompt.kl_massive)[:, layer])
    return claims.Sample(claims.paired(*kl), claims.relative_drop)


def _at_layers(stat: Callable[[Result, int], claims.Measure]) -> Callable[[Result], claims.Placebo]:
    return claims.placebo_of(stat, lambda r: r.me_layer, lambda r: range(len(r.layers)))


def _frac_details(r: Result) -> str:
    fm, fo, fm0, fo0 = _frac_rows(r).mean(0)
    return (
        f"ME layer {r.me_text()}; K = {r.k} of {r.d_model} dims; after the gain: mean Frac massive "
        f"{fm:.3g}, others {fo:.3g} (ΔFrac {fm - fo:.3g}); before the gain (h / rms): massive "
        f"{fm0:.3g}, others {fo0:.3g} (ΔFrac {fm0 - fo0:.3g})"
    )


def _kl_details(r: Result) -> str:
    km = as_array(r.per_prompt.kl_massive)[:, r.me_layer]
    ko = as_array(r.per_prompt.kl_others)[:, r.me_layer]
    return (
        f"ME layer {r.me_text()}; mean KL massive {km.mean():.3g} nats, others {ko.mean():.3g} "
        f"(ΔKL {(km - ko).mean():.3g})"
    )


def _neuron_measure(r: Result) -> claims.Sample:
    share = as_array(r.per_prompt.selected_neuron_share)
    null = as_array(r.per_prompt.random_neuron_share)
    rows = r.units.prompts(r.units.heldout)
    unit = "held-out prompts" if r.units.held_out else "prompts (nothing held out)"
    return claims.Sample(share[rows] - null[rows], unit=unit, prompts=rows)  # units: the header's


def _neuron_details(r: Result) -> str:
    top = r.neurons.neurons[:N_TOP]
    rows = r.units.prompts(r.units.heldout)
    held = as_array(r.per_prompt.selected_neuron_share)[rows].mean()
    null = as_array(r.per_prompt.random_neuron_share)[rows].mean()
    return (
        f"neuron layer {r.neuron_layer} ({r.neurons.chosen_as}); top {N_TOP} of the selection "
        f"half: {r.selected_neurons}; {r.units.text()}; held-out share {held:.3g}, random "
        f"{N_TOP} neurons {null:.3g}; top neurons on all prompts "
        + ", ".join(f"{n.neuron} ({100 * n.share:.1f} %)" for n in top)
    )


SPECS: tuple[claims.Spec, ...] = (
    claims.Spec(
        "mechanism.frac_aligned",
        "§2.2",
        "At the ME layer the pre-FFN RMSNorm's gain puts the massive token's energy on the top-|w| "
        "dims: after the gain its share there exceeds the other tokens' by a margin (ΔFrac > 0), "
        "and the gain widened that excess (compared with h / rms before the gain)",
        statistic="min of (a) 1 − mean Frac_others / mean Frac_massive after the gain and (b) "
        "(E − E₀) / max(|E|, |E₀|), with E = mean ΔFrac after the gain and E₀ before it "
        "(the standardised h / rms on the same K = TopK(|w|) dims), at the ME layer",
        op=">=",
        threshold="relative_drop",
        control="(a) the other tokens of the same prompts at the same layer; (b) the same tokens "
        "before the gain",
        stat=_frac,
        details=_frac_details,
        placebo=_at_layers(_frac),
    ),
    _peak_spec("frac_peak", "§2.2", "ΔFrac", "ΔFrac"),
    claims.Spec(
        "mechanism.kl_aligned",
        "§2.2",
        "At the ME layer the massive token's energy distribution is closer to the gain distribution "
        "than the other tokens' (ΔKL < 0, by a margin)",
        statistic="1 − mean KL(p_massive‖g) / mean KL(p_others‖g) at the ME layer",
        op=">=",
        threshold="relative_drop",
        control="the other tokens of the same prompts at the same layer",
        stat=_kl,
        details=_kl_details,
        placebo=_at_layers(_kl),
    ),
    _peak_spec("kl_peak", "§2.2", "−ΔKL (the alignment to the gains)", "−ΔKL"),
    _peak_spec("dc_gate_peak", "§2.3", "ΔC after W_gate", "ΔC after W_gate"),
    _peak_spec("dc_up_peak", "§2.3", "ΔC after W_up", "ΔC after W_up"),
    _peak_spec(
        "dc_down_peak",
        "§2.3",
        "ΔC after W_down (the FFN output)",
        "ΔC after W_down",
        "me_layer.ffn_creates",
    ),
    _peak_spec(
        "magnification_peak",
        "§2.3",
        "The FFN magnification ‖FFN(ĥ)‖ / ‖ĥ‖ of the massive token",
        "log10 FFN magnification of the massive token",
        "me_layer.ffn_creates",
    ),
    claims.Spec(
        "mechanism.few_neurons",
        "§2.3",
        f"A few FFN neurons write the massive token's FFN output at the ME layer: the top {N_TOP}, "
        "chosen on other prompts, carry nearly all of it",
        statistic=f"mean over the held-out prompts of the share of the top-{N_TOP} neurons of the "
        "selection half (ranked by their mean share there) in the massive token's FFN output, "
        f"minus the mean share of {N_TOP} random neurons ({N_TOP} × the mean share); "
        "s_n = a_n ⟨W_down[:, n], y⟩ / ‖y‖²",
        op=">=",
        threshold="concentration_share",
        control=f"{N_TOP} random neurons of the same layer (the null subtracted); the held-out "
        "prompts, so the selection never scores itself",
        unit="held-out prompts",
        stat=_neuron_measure,
        details=_neuron_details,
        massive_state=True,
    ),
)


@dataclass(frozen=True)
class Config(DetectConfig):
    """Mechanism settings.

    Attributes:
        k_frac: ``K`` of ``TopK(|w|, K)`` as a fraction of d_model (used when ``k_abs`` is 0).
        k_abs: ``K`` as an absolute number of dims (0: use ``k_frac``).
        top_neurons: rows of the neuron table.
        neuron_layer: layer of the neuron table (-1: the ME layer).
    """

    k_frac: float = checked(0.01, gt=0, le=1)
    k_abs: int = checked(0, ge=0)
    top_neurons: int = checked(10, ge=1)
    neuron_layer: int = checked(-1, ge=0, also=(-1,))

    def k(self) -> int | float:
        return self.k_abs if self.k_abs > 0 else float(self.k_frac)


@dataclass(frozen=True)
class Layer:
    """Per layer, the means over prompts: ΔFrac and ΔKL at the pre-FFN norm output (``delta_frac``,
    ``delta_kl``) and at each of ``probes.alignment.ALIGN_SITES``; Frac, KL and the weight norm of
    the massive token and of the others at the pre-FFN norm output; the Herfindahl concentration per
    FFN stage (massive minus others, massive, others); the FFN magnification."""

    layer: int
    layer_1based: int
    delta_frac: float
    delta_kl: float
    delta_frac_ffn_in: float
    delta_kl_ffn_in: float
    delta_frac_ffn_normalized: float
    delta_kl_ffn_normalized: float
    delta_frac_attn_in: float
    delta_kl_attn_in: float
    delta_frac_attn_normalized: float
    delta_kl_attn_normalized: float
    frac_massive: float
    frac_others: float
    kl_massive: float
    kl_others: float
    weight_norm_massive: float
    weight_norm_others: float
    delta_c: Stages
    c_massive: Stages
    c_others: Stages
    magnification: float
    magnification_others: float
    magnification_residual: float | None = None


@dataclass(frozen=True)
class PerPrompt:
    """The ``[prompt][layer]`` statistics behind the claims (the standardised h / rms before the gain
    in ``*_pregain``; ``*_residual`` on sandwich-norm models only) and, per prompt,
    ``selected_neuron_share`` (the share of ``Result.selected_neurons``, the top-:data:`N_TOP`
    neurons of the neuron layer on the selection half) and ``random_neuron_share`` (the mean share of
    :data:`N_TOP` random neurons: ``N_TOP`` × the mean share)."""

    delta_frac: list[list[float]]
    frac_massive: list[list[float]]
    frac_others: list[list[float]]
    delta_kl: list[list[float]]
    kl_massive: list[list[float]]
    kl_others: list[list[float]]
    frac_massive_pregain: list[list[float]]
    frac_others_pregain: list[list[float]]
    delta_c_input: list[list[float]]
    delta_c_gate: list[list[float]]
    delta_c_up: list[list[float]]
    delta_c_product: list[list[float]]
    delta_c_down: list[list[float]]
    magnification: list[list[float]]
    magnification_others: list[list[float]]
    selected_neuron_share: list[float]
    random_neuron_share: list[float]
    magnification_residual: list[list[float]] | None = None
    delta_c_residual: list[list[float]] | None = None


@dataclass(frozen=True)
class Neurons:
    """The top neurons of the neuron layer, ``chosen_as`` ``given`` or ``ME layer``."""

    layer: int
    layer_1based: int
    n_prompts: int
    neurons: list[Neuron]
    chosen_as: str


@dataclass(frozen=True)
class GainRanks:
    """Per layer, where the massive dims rank in the pre-FFN and pre-attention gains ``|w|``."""

    ffn: list[list[GainRank]]
    attn: list[list[GainRank]]


@dataclass(frozen=True)
class Result(LayerReport):
    """What :func:`run` measured (see :class:`Layer`, :class:`PerPrompt`)."""

    massive_dims: list[int]
    massive_positions: list[list[int]]
    reference_positions: list[int]
    k: int
    d_model: int
    layers: list[Layer]
    neurons: Neurons
    neuron_layer: int
    gain_ranks: GainRanks
    ffn_gain_at_me: list[float]
    selected_neurons: list[int]
    per_prompt: PerPrompt


def _mean(x) -> float:
    return float(x.nanmean())


def inputs(cfg: Config, model: LoadedModel) -> Inputs:
    """The prompts and one forward pass: their norm scan, alignment and FFN recorders (``made``)."""
    batch = model.tokenize(cfg.load_prompts())
    align = AlignmentRecorder(model, batch, k=cfg.k(), sites=ALIGN_SITES)
    return scanned_inputs(model, batch, align, FFNRecorder(model, batch))


def run(cfg: Config, model: LoadedModel | None = None, site: Site | None = None) -> Result:
    """Measure alignment and concentration at every layer. No printing, no files.

    Raises:
        claims.NotApplicable: the model has no massive activation and ``cfg.layer`` is not given.
    """
    model, site = prepare(EXPERIMENT, cfg, model, site)
    batch, (align, ffn) = site.batch, site.inputs.made
    det = detect(site)
    me, ref = det.me_layer, det.reference
    nl = model.check_layer(cfg.neuron_layer) if cfg.neuron_layer >= 0 else me
    at = FFNAtRecorder(model, batch, ref, last_layer=max(me, nl))
    record(model, batch, [at], upto=[r + 1 for r in ref], last_layer=max(me, nl))
    al = align.result(ref)
    fs = make_scan(ffn, at)
    mag, mag_o = fs.magnification(), fs.magnification_others()
    per: dict[str, torch.Tensor] = {
        "delta_frac": al.delta_frac("ffn_in"),
        "frac_massive": al.massive("frac", "ffn_in"),
        "frac_others": al.others("frac", "ffn_in"),
        "delta_kl": al.delta_kl("ffn_in"),
        "kl_massive": al.massive("kl", "ffn_in"),
        "kl_others": al.others("kl", "ffn_in"),
        "frac_massive_pregain": al.massive("frac", "ffn_normalized"),
        "frac_others_pregain": al.others("frac", "ffn_normalized"),
        **{f"delta_c_{s}": fs.delta_c(s) for s in STAGES},
        "magnification": mag,
        "magnification_others": mag_o,
    }
    mag_res = fs.magnification_residual()  # sandwich norms: also after the post-FFN norm
    if mag_res is not None:
        per["magnification_residual"] = mag_res
        per[f"delta_c_{RESIDUAL_STAGE}"] = fs.delta_c(RESIDUAL_STAGE)

    layers = [
        Layer(
            layer=L,
            layer_1based=L + 1,
            delta_frac=_mean(per["delta_frac"][L]),
            delta_kl=_mean(per["delta_kl"][L]),
            **al.layer_means(L),
            delta_c=fs.stage_means("delta", L),
            c_massive=fs.stage_means("massive", L),
            c_others=fs.stage_means("others", L),
            magnification=_mean(mag[L]),
            magnification_others=_mean(mag_o[L]),
            magnification_residual=None if mag_res is None else _mean(mag_res[L]),
        )
        for L in range(model.n_layers)
    ]
    table = top_neurons(model, fs, nl, cfg.top_neurons)
    neurons = Neurons(
        layer=table.layer,
        layer_1based=table.layer + 1,
        n_prompts=table.n_prompts,
        neurons=table.rows(),
        chosen_as="given" if cfg.neuron_layer >= 0 else "ME layer",
    )
    shares = neuron_contributions(fs.act_at_ref[nl], model.ffn_weights(nl).down)  # [batch d_mlp]
    sel = det.site.units.prompts(det.site.units.select)
    chosen = shares[sel].mean(0).argsort(descending=True)[:N_TOP].tolist()  # on the selection half
    loc = det.site.location
    dims = list(loc.massive_dims[:4])
    ranks = massive_dim_gain_ranks(model, dims, al.k) if dims else {"ffn": [], "attn": []}
    return Result(
        **det.report_fields(cfg, model, batch),
        massive_dims=list(loc.massive_dims),
        massive_positions=det.massive_positions,
        reference_positions=ref,
        k=al.k,
        d_model=model.d_model,
        layers=layers,
        neurons=neurons,
        neuron_layer=nl,
        gain_ranks=GainRanks(ffn=ranks["ffn"], attn=ranks["attn"]),
        ffn_gain_at_me=model.ffn_norm_gain(me).detach().float().cpu().tolist(),
        selected_neurons=[int(n) for n in chosen],
        per_prompt=PerPrompt(
            **{k: v.T.tolist() for k, v in per.items()},
            selected_neuron_share=shares[:, chosen].sum(-1).tolist(),
            random_neuron_share=(N_TOP * shares.mean(-1)).tolist(),
        ),
    )


def figures(result: Result) -> dict[str, go.Figure]:
    me, nl, rows, top = result.me_layer, result.neuron_layer, result.layers, result.neurons.neurons
    k = f"K = {result.k} of {result.d_model} dims"
    gl = me if me is not None else nl
    marks = [(g.dim, g.rank, g.abs_gain) for g in (result.gain_ranks.ffn or [[]] * (gl + 1))[gl]]

    return {
        "delta_frac": plotting.layer_lines(
            {
                "pre-FFN RMSNorm output (after gain)": [r.delta_frac_ffn_in for r in rows],
                "pre-FFN standardised h/rms (before gain)": [
                    r.delta_frac_ffn_normalized for r in rows
                ],
                "pre-attention RMSNorm output (after gain)": [r.delta_frac_attn_in for r in rows],
            },
            f"ΔFrac: share of energy on the top-|w| dims, massive token minus others ({k})",
            "ΔFrac (fraction, > 0: massive token more aligned)",
            me,
        ),
        "delta_kl": plotting.layer_lines(
            {
                "pre-FFN RMSNorm output (after gain)": [r.delta_kl_ffn_in for r in rows],
                "pre-FFN standardised h/rms (before gain)": [
                    r.delta_kl_ffn_normalized for r in rows
                ],
                "pre-attention RMSNorm output (after gain)": [r.delta_kl_attn_in for r in rows],
            },
            "ΔKL(p‖g): energy distribution vs gain distribution, massive token minus others",
            "ΔKL (nats, < 0: massive token closer to the gains)",
            me,
        ),
        "delta_c": plotting.layer_lines(
            {STAGE_LABELS[s]: [getattr(r.delta_c, s) for r in rows] for s in STAGES},
            "ΔC: Herfindahl concentration of the massive token minus the others, per FFN stage",
            "ΔC (dimensionless, 1 = one-hot)",
            me,
        ),
        "ffn_magnification": plotting.layer_lines(
            {
                "massive token": [r.magnification for r in rows],
                "mean of other tokens": [r.magnification_others for r in rows],
            },
            "FFN magnification ‖FFN(ĥ)‖ / ‖ĥ‖ per layer (mean over prompts)",
            "magnification (ratio, log scale)",
            me,
            log_y=True,
        ),
        "top_neurons": plotting.neuron_shares(
            [n.neuron for n in top],
            [n.share for n in top],
            f"Top FFN neurons of layer {nl} (1-based {nl + 1}, {result.neurons.chosen_as}) by share "
            "of the massive token's FFN output",
        ),
        "massive_dim_gains": plotting.sorted_gains(
            result.ffn_gain_at_me,
            marks,
            result.k,
            f"Pre-FFN RMSNorm gains |w| of layer {gl} (1-based {gl + 1}) sorted, massive dims marked",
        ),
    }


def summary(result: Result) -> str:
    table = result.layer_table(
        [f"ME layer: {result.me_text()}", f"K = {result.k}"],
        ["dFrac", "dKL", "dC gate", "dC up", "dC prod", "dC down", "magnif"],
        lambda r: (
            r.delta_frac,
            r.delta_kl,
            r.delta_c.gate,
            r.delta_c.up,
            r.delta_c.product,
            r.delta_c.down,
            r.magnification,
        ),
    )
    ntab = fmt_table(
        ["neuron", "share", "activation"],
        [(n.neuron, n.share, n.activation) for n in result.neurons.neurons],
    )
    return "\n\n".join([table, f"top neurons of layer {result.neuron_layer}:\n{ntab}"])


EXPERIMENT = Experiment(
    NAME,
    Config,
    run,
    SPECS,
    figures,
    summary,
    __doc__,
    key_figures=("delta_frac", "delta_c"),
    inputs=inputs,
)
main = command(EXPERIMENT)


if __name__ == "__main__":
    raise SystemExit(main())
