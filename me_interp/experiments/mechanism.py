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

Claims (:data:`SPECS`; thresholds from ``claims.THRESHOLDS``; intervals bootstrapped over prompts).
Those that the ME-layer detection nearly implies ("peaks at the ME layer") are judged against the null
of every other layer (``claims.null_z``), never by an argmax. On a model without a massive activation
``run`` raises ``claims.NotApplicable``.

    python -m me_interp.experiments.mechanism                      # bundled model, built-in prompts
    python -m me_interp.experiments.mechanism --k-frac 0.05 --neuron-layer 11

``result.json`` keys are documented in docs/probes.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import plotly.graph_objects as go
import torch

from me_interp import claims, names, plotting
from me_interp.experiments._layer_report import (
    DetectConfig,
    LayerReport,
    as_array,
    detect,
    peak_z,
    relative_drop,
)
from me_interp.experiments.common import (
    cli_main,
    fmt_table,
    model_for,
)
from me_interp.models import LoadedModel
from me_interp.probes.alignment import (
    ALIGN_SITES,
    AlignmentRecorder,
    massive_dim_gain_ranks,
    resolve_k,
)
from me_interp.probes.batching import record
from me_interp.probes.ffn import (
    RESIDUAL_STAGE,
    STAGES,
    FFNAtRecorder,
    FFNRecorder,
    make_scan,
    neuron_contributions,
    top_neurons,
)
from me_interp.probes.norms import NormRecorder

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
# the mechanism experiment
# ------------------------------------------------------------------------------------------


def _peak_spec(short: str, section: str, what: str, statistic: str) -> claims.Spec:
    return claims.Spec(
        f"mechanism.{short}",
        section,
        f"{what} peaks at the ME layer (judged against the null of every other layer: the ME layer "
        "is where the FFN makes the norm jump, so an argmax would be nearly implied)",
        statistic=f"z of the ME layer's {statistic} against the other layers' (claims.null_z of the "
        "per-layer means), bootstrapped over prompts",
        op=">=",
        threshold="null_z",
        control="the same statistic at every other layer",
    )


SPECS: tuple[claims.Spec, ...] = (
    claims.Spec(
        "mechanism.frac_aligned",
        "§2.2",
        "At the ME layer the pre-FFN RMSNorm puts more of the massive token's energy on the top-|w| "
        "dims than the other tokens' (ΔFrac > 0, by a margin)",
        statistic="1 − mean Frac_others / mean Frac_massive at the ME layer (pre-FFN RMSNorm output "
        "after the gain, K = TopK(|w|))",
        op=">=",
        threshold="relative_drop",
        control="the other tokens of the same prompts at the same layer",
    ),
    _peak_spec("frac_peak", "§2.2", "ΔFrac", "mean ΔFrac"),
    claims.Spec(
        "mechanism.kl_aligned",
        "§2.2",
        "At the ME layer the massive token's energy distribution is closer to the gain distribution "
        "than the other tokens' (ΔKL < 0, by a margin)",
        statistic="1 − mean KL(p_massive‖g) / mean KL(p_others‖g) at the ME layer",
        op=">=",
        threshold="relative_drop",
        control="the other tokens of the same prompts at the same layer",
    ),
    _peak_spec("kl_peak", "§2.2", "−ΔKL (the alignment to the gains)", "mean −ΔKL"),
    _peak_spec("dc_gate_peak", "§2.3", "ΔC after W_gate", "mean ΔC after W_gate"),
    _peak_spec("dc_up_peak", "§2.3", "ΔC after W_up", "mean ΔC after W_up"),
    _peak_spec("dc_down_peak", "§2.3", "ΔC after W_down (the FFN output)", "mean ΔC after W_down"),
    _peak_spec(
        "magnification_peak",
        "§2.3",
        "The FFN magnification ‖FFN(ĥ)‖ / ‖ĥ‖ of the massive token",
        "mean log10 magnification",
    ),
    claims.Spec(
        "mechanism.few_neurons",
        "§2.3",
        f"A few FFN neurons write the massive token's FFN output at the ME layer (the top {N_TOP})",
        statistic=f"mean over prompts of the share of the top-{N_TOP} neurons (ranked by their mean "
        "share) in the massive token's FFN output, s_n = a_n ⟨W_down[:, n], y⟩ / ‖y‖²",
        op=">=",
        threshold="concentration_share",
        control="all other neurons of the layer (the shares sum to 1)",
    ),
)
(
    FRAC_ALIGNED,
    FRAC_PEAK,
    KL_ALIGNED,
    KL_PEAK,
    DC_GATE_PEAK,
    DC_UP_PEAK,
    DC_DOWN_PEAK,
    MAGNIFICATION_PEAK,
    FEW_NEURONS,
) = SPECS
_DC_PEAKS = {"gate": DC_GATE_PEAK, "up": DC_UP_PEAK, "down": DC_DOWN_PEAK}


@dataclass(frozen=True)
class Config(DetectConfig):
    """Mechanism settings.

    Attributes:
        k_frac: ``K`` of ``TopK(|w|, K)`` as a fraction of d_model (used when ``k_abs`` is 0).
        k_abs: ``K`` as an absolute number of dims (0: use ``k_frac``).
        top_neurons: rows of the neuron table.
        neuron_layer: layer of the neuron table (-1: the ME layer).
    """

    k_frac: float = 0.01
    k_abs: int = 0
    top_neurons: int = 10
    neuron_layer: int = -1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.k_abs < 0:
            raise ValueError("k_abs must be >= 0")
        if self.k_abs == 0:
            resolve_k(float(self.k_frac), 10**6)  # validates the fraction
        if self.top_neurons < 1:
            raise ValueError("top_neurons must be >= 1")
        if self.neuron_layer < -1:
            raise ValueError("neuron_layer must be -1 (the ME layer) or a 0-based layer")

    def k(self) -> int | float:
        return self.k_abs if self.k_abs > 0 else float(self.k_frac)


@dataclass
class Result(LayerReport):
    """What :func:`run` measured. ``per_prompt`` holds the ``[prompt][layer]`` statistics behind the
    claims (``delta_frac``, ``frac_massive``, ``frac_others``, ``delta_kl``, ``kl_massive``,
    ``kl_others``, ``delta_c_<stage>``, ``magnification``, ``magnification_others``) and, per
    prompt, ``top_neuron_share`` (the share of the top-:data:`N_TOP` neurons of the neuron layer)."""

    massive_dims: list[int]
    massive_positions: list[list[int]]
    reference_positions: list[int]
    k: int
    d_model: int
    neurons: dict[str, Any]
    neuron_layer: int
    gain_ranks: dict[str, list[list[dict]]]
    ffn_gain_at_me: list[float]
    per_prompt: dict[str, list] = field(default_factory=dict)
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.header(),
            "massive_dims": self.massive_dims,
            "massive_positions": self.massive_positions,
            "reference_positions": self.reference_positions,
            "n_prompts": self.n_prompts,
            "k": self.k,
            "d_model": self.d_model,
            "layers": self.layers,
            "neurons": self.neurons,
            "gain_ranks": self.gain_ranks,
            "per_prompt": self.per_prompt,
        }


def _mean(x) -> float:
    return float(x.nanmean())


def run(cfg: Config, model: LoadedModel | None = None) -> Result:
    """Measure alignment and concentration at every layer. No printing, no files.

    Raises:
        claims.NotApplicable: the model has no massive activation and ``cfg.layer`` is not given.
    """
    model = model_for(cfg, model)
    batch = model.tokenize(cfg.load_prompts())
    norms = NormRecorder(model, batch, names.SITES)
    align = AlignmentRecorder(model, batch, k=cfg.k(), sites=ALIGN_SITES)
    ffn = FFNRecorder(model, batch)
    record(model, batch, [norms, align, ffn])
    det = detect(cfg, model, norms.result())
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
        **{f"delta_c_{s}": fs.delta_c(s) for s in STAGES},
        "magnification": mag,
        "magnification_others": mag_o,
    }
    mag_res = fs.magnification_residual()  # sandwich norms: also after the post-FFN norm
    if mag_res is not None:
        per["magnification_residual"] = mag_res
        per[f"delta_c_{RESIDUAL_STAGE}"] = fs.delta_c(RESIDUAL_STAGE)
    layers = []
    for L in range(model.n_layers):
        row: dict[str, Any] = {"layer": L, "layer_1based": L + 1}
        row["delta_frac"] = _mean(per["delta_frac"][L])
        row["delta_kl"] = _mean(per["delta_kl"][L])
        for s in ALIGN_SITES:
            row[f"delta_frac_{s}"] = _mean(al.delta_frac(s)[L])
            row[f"delta_kl_{s}"] = _mean(al.delta_kl(s)[L])
        for m in ("frac", "kl", "weight_norm"):
            row[f"{m}_massive"] = _mean(al.massive(m, "ffn_in")[L])
            row[f"{m}_others"] = _mean(al.others(m, "ffn_in")[L])
        row["delta_c"] = {s: _mean(fs.delta_c(s)[L]) for s in STAGES}
        row["c_massive"] = {s: _mean(fs.massive_c(s)[L]) for s in STAGES}
        row["c_others"] = {s: _mean(fs.others_c(s)[L]) for s in STAGES}
        row["magnification"] = _mean(mag[L])
        row["magnification_others"] = _mean(mag_o[L])
        if mag_res is not None:
            row["magnification_residual"] = _mean(mag_res[L])
            row["delta_c"][RESIDUAL_STAGE] = _mean(per[f"delta_c_{RESIDUAL_STAGE}"][L])
        layers.append(row)
    table = top_neurons(model, fs, nl, cfg.top_neurons).to_dict()
    table["chosen_as"] = "given" if cfg.neuron_layer >= 0 else "ME layer"
    shares = neuron_contributions(fs.act_at_ref[nl], model.ffn_weights(nl).down)
    top = [n["neuron"] for n in table["neurons"][:N_TOP]]
    loc = det.location
    dims = list(loc.massive_dims[:4])
    ranks = massive_dim_gain_ranks(model, dims, al.k) if dims else {"ffn": [], "attn": []}
    result = Result(
        model=model.name,
        bos=model.bos,
        bos_prepended=model.bos_prepended(batch),
        n_prompts=len(batch),
        me_layer=me,
        detected_me_layer=loc.me_layer,
        massive_dims=list(loc.massive_dims),
        massive_positions=det.massive_positions,
        reference_positions=ref,
        k=al.k,
        d_model=model.d_model,
        layers=layers,
        neurons=table,
        neuron_layer=nl,
        gain_ranks={n: [[g.to_dict() for g in row] for row in v] for n, v in ranks.items()},
        ffn_gain_at_me=model.ffn_norm_gain(me).detach().float().cpu().tolist(),
        per_prompt={
            **{k: v.T.tolist() for k, v in per.items()},
            "top_neuron_share": shares[:, top].sum(-1).tolist(),
        },
        seed=cfg.seed,
    )
    return result


def verdicts(result: Result) -> list[claims.Claim]:
    """The paper's claims 2 and 3 on this model, with intervals bootstrapped over prompts."""
    me, seed, pp = result.me_layer, result.seed, result.per_prompt
    at = f"ME layer {result.me_text()}"
    fm, fo = as_array(pp, "frac_massive")[:, me], as_array(pp, "frac_others")[:, me]
    out = [
        FRAC_ALIGNED.judge(
            relative_drop(fm, fo, seed),
            details=f"{at}; K = {result.k} of {result.d_model} dims; mean Frac massive "
            f"{fm.mean():.3g}, others {fo.mean():.3g} (ΔFrac {(fm - fo).mean():.3g})",
        )
    ]
    dfrac = as_array(pp, "delta_frac")
    out.append(FRAC_PEAK.judge(peak_z(dfrac, me, seed), details=_peak_details(at, dfrac, me)))
    km, ko = as_array(pp, "kl_massive")[:, me], as_array(pp, "kl_others")[:, me]
    out.append(
        KL_ALIGNED.judge(
            relative_drop(ko, km, seed),
            details=f"{at}; mean KL massive {km.mean():.3g} nats, others {ko.mean():.3g} "
            f"(ΔKL {(km - ko).mean():.3g})",
        )
    )
    neg_dkl = -as_array(pp, "delta_kl")
    out.append(KL_PEAK.judge(peak_z(neg_dkl, me, seed), details=_peak_details(at, neg_dkl, me)))
    for stage, spec in _DC_PEAKS.items():
        dc = as_array(pp, f"delta_c_{stage}")
        out.append(spec.judge(peak_z(dc, me, seed), details=_peak_details(at, dc, me)))
    with np.errstate(divide="ignore", invalid="ignore"):
        logmag = np.log10(as_array(pp, "magnification"))
    out.append(
        MAGNIFICATION_PEAK.judge(
            peak_z(logmag, me, seed),
            details=_peak_details(at, logmag, me)
            + f"; magnification at ME {10 ** np.nanmean(logmag[:, me]):.4g} (geometric mean), "
            f"other tokens {np.nanmean(as_array(pp, 'magnification_others')[:, me]):.3g}",
        )
    )
    share = as_array(pp, "top_neuron_share")
    top = result.neurons["neurons"][:N_TOP]
    out.append(
        FEW_NEURONS.judge(
            claims.bootstrap(share, seed=seed),
            details=f"neuron layer {result.neuron_layer} ({result.neurons['chosen_as']}); top "
            "neurons " + ", ".join(f"{n['neuron']} ({100 * n['share']:.1f} %)" for n in top),
        )
    )
    return out


def _peak_details(at: str, values: np.ndarray, me: int) -> str:
    means = np.nanmean(values, axis=0)
    others = np.delete(means, me)
    best = int(np.nanargmax(np.where(np.isfinite(means), means, np.nan)))
    return (
        f"{at}; per-layer mean {means[me]:.3g} at ME vs {np.nanmean(others):.3g} ± "
        f"{np.nanstd(others, ddof=1):.3g} at the other layers; largest at layer {best}"
    )


def figures(result: Result) -> dict[str, go.Figure]:
    me = result.me_layer
    k = f"K = {result.k} of {result.d_model} dims"
    frac = plotting.layer_lines(
        {
            "pre-FFN RMSNorm output (after gain)": result.series("delta_frac_ffn_in"),
            "pre-FFN standardised h/rms (before gain)": result.series("delta_frac_ffn_normalized"),
            "pre-attention RMSNorm output (after gain)": result.series("delta_frac_attn_in"),
        },
        f"ΔFrac: share of energy on the top-|w| dims, massive token minus others ({k})",
        "ΔFrac (fraction, > 0: massive token more aligned)",
        me,
    )
    kl = plotting.layer_lines(
        {
            "pre-FFN RMSNorm output (after gain)": result.series("delta_kl_ffn_in"),
            "pre-FFN standardised h/rms (before gain)": result.series("delta_kl_ffn_normalized"),
            "pre-attention RMSNorm output (after gain)": result.series("delta_kl_attn_in"),
        },
        "ΔKL(p‖g): energy distribution vs gain distribution, massive token minus others",
        "ΔKL (nats, < 0: massive token closer to the gains)",
        me,
    )
    dc = plotting.layer_lines(
        {STAGE_LABELS[s]: result.series("delta_c", s) for s in STAGES},
        "ΔC: Herfindahl concentration of the massive token minus the others, per FFN stage",
        "ΔC (dimensionless, 1 = one-hot)",
        me,
    )
    mag = plotting.layer_lines(
        {
            "massive token": result.series("magnification"),
            "mean of other tokens": result.series("magnification_others"),
        },
        "FFN magnification ‖FFN(ĥ)‖ / ‖ĥ‖ per layer (mean over prompts)",
        "magnification (ratio, log scale)",
        me,
        log_y=True,
    )
    rows = result.neurons["neurons"]
    neurons = go.Figure(
        go.Bar(
            x=[f"n{r['neuron']}" for r in rows],
            y=[100 * r["share"] for r in rows],
            hovertemplate="neuron %{x}: %{y:.3g} % of the FFN output<extra></extra>",
        )
    )
    nl = result.neuron_layer
    neurons.update_layout(
        title=f"Top FFN neurons of layer {nl} (1-based {nl + 1}, {result.neurons['chosen_as']}) by "
        "share of the massive token's FFN output",
        xaxis_title="FFN neuron (index in d_mlp)",
        yaxis_title="share of the FFN output (%; signed projection, all neurons sum to 100)",
        template="plotly_white",
    )
    gain = [abs(x) for x in result.ffn_gain_at_me]
    order = sorted(range(len(gain)), key=lambda i: -gain[i])
    gl = result.me_layer if result.me_layer is not None else nl
    gfig = go.Figure(
        go.Scatter(
            x=list(range(1, len(gain) + 1)),
            y=[gain[i] for i in order],
            mode="lines",
            name="|w| sorted",
            customdata=order,
            hovertemplate="rank %{x}: dim %{customdata}, |w| = %{y:.3g}<extra></extra>",
        )
    )
    for g in (result.gain_ranks.get("ffn") or [[]] * (gl + 1))[gl]:
        gfig.add_trace(
            go.Scatter(
                x=[g["rank"]],
                y=[g["abs_gain"]],
                mode="markers+text",
                marker=dict(size=11, color="firebrick"),
                text=[f"massive dim {g['dim']}"],
                textposition="top center",
                name=f"massive dim {g['dim']} (rank {g['rank']})",
            )
        )
    gfig.add_vline(
        x=result.k, line_dash="dot", line_color="gray", annotation_text=f"K = {result.k}"
    )
    gfig.update_layout(
        title=f"Pre-FFN RMSNorm gains |w| of layer {gl} (1-based {gl + 1}) sorted, massive dims marked",
        xaxis_title="rank of |w| (1 = largest)",
        yaxis_title="|w| (gain, log scale)",
        yaxis_type="log",
        template="plotly_white",
    )
    return {
        "delta_frac": frac,
        "delta_kl": kl,
        "delta_c": dc,
        "ffn_magnification": mag,
        "top_neurons": neurons,
        "massive_dim_gains": gfig,
    }


def summary(result: Result) -> str:
    head = (
        f"model: {result.model}   bos: {result.bos}   prompts: {result.n_prompts}   "
        f"ME layer: {result.me_text()}   K = {result.k}"
    )
    table = result.layer_table(
        ["dFrac", "dKL", "dC gate", "dC up", "dC prod", "dC down", "magnif"],
        lambda r: (
            r["delta_frac"],
            r["delta_kl"],
            r["delta_c"]["gate"],
            r["delta_c"]["up"],
            r["delta_c"]["product"],
            r["delta_c"]["down"],
            r["magnification"],
        ),
    )
    ntab = fmt_table(
        ["neuron", "share", "activation"],
        [(n["neuron"], n["share"], n["activation"]) for n in result.neurons["neurons"]],
    )
    return "\n\n".join([head, table, f"top neurons of layer {result.neuron_layer}:\n{ntab}"])


def main(argv: Sequence[str] | None = None) -> int:
    return cli_main(NAME, Config, run, figures, summary, argv, description=__doc__)


if __name__ == "__main__":
    raise SystemExit(main())
