"""Component ablation at the ME layer: RMSNorm-only, FFN-only and residual-stream interventions.

Which part of the ME layer makes the massive activation, and does the model need it? Each condition
touches only the massive token ``p`` at the ME layer (both measured by the ME-layer probe) and is
measured by the norm ratio ``‖h_p‖ / mean_{t≠p}‖h_t‖`` at the ME-layer output and at the last layer,
the attention of the layers after the ME layer to ``p`` (mean over heads and queries ``q > p``) and the
perplexity of the prompts (``evaluation.perplexity``):

* ``flatten_gain``      — RMSNorm-only: the pre-FFN norm output of ``p`` is ``ĥ_p ⊙ mean(w)``;
* ``cap_ffn``           — FFN-only: ``‖FFN_p‖`` capped at the median FFN-output norm of the others;
* ``scale_product``     — FFN-only: the intermediate product ``act(W_gate x) ⊙ W_up x`` of ``p`` × α;
* ``normalize_product`` — FFN-only: that product rescaled to the other tokens' mean norm;
* ``zero_dims``         — residual: the massive dims of ``p`` at the ME-layer output set to 0
  (Owen et al.: ruins some models, not others);
* ``mean_dims``         — residual: those dims set to their mean over the prompts (Sun et al.:
  perplexity unchanged).

A condition *removes* the massive activation when the ME-layer norm ratio falls to at most
``--removed-fraction`` (0.05) of the unmodified one. ``result.json`` leads with the FFN claim (``cap_ffn``).

    python -m me_interp.experiments.component_ablation
    python -m me_interp.experiments.component_ablation --alpha 0.5 --conditions cap_ffn zero_dims
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import plotly.graph_objects as go

from me_interp.evaluation import perplexity
from me_interp.experiments.common import SiteConfig, check_choices, cli_main, fmt_table, model_for
from me_interp.interventions import causal
from me_interp.models import LoadedModel
from me_interp.patching import NormRatio, SinkMass, evaluate_metrics

NAME = "component_ablation"
CONDITIONS: tuple[str, ...] = (
    "flatten_gain",
    "cap_ffn",
    "scale_product",
    "normalize_product",
    "zero_dims",
    "mean_dims",
)
CLAIM = (
    "The ME layer's FFN creates the massive activation: capping the massive token's FFN output at "
    "the median of the other tokens' removes it"
)


@dataclass(frozen=True)
class Config(SiteConfig):
    """Component-ablation settings.

    Attributes:
        conditions: the interventions to run, each separately (``flatten_gain``, ``cap_ffn``,
            ``scale_product``, ``normalize_product``, ``zero_dims``, ``mean_dims``).
        alpha: factor α of ``scale_product`` (the FFN intermediate product of ``p`` × α).
        removed_fraction: a condition removes the massive activation when the ME-layer norm ratio
            falls to at most this fraction of the unmodified one, in (0, 1).
        ppl_tolerance: ``mean_dims`` verdict: perplexity counts as unchanged when
            ``|ppl / ppl_baseline − 1|`` is at most this (> 0).
        ppl_damage: ``zero_dims`` verdict: the model counts as hurt when perplexity grows by at least
            this factor (> 1).
    """

    conditions: tuple[str, ...] = CONDITIONS
    alpha: float = 0.1
    removed_fraction: float = 0.05
    ppl_tolerance: float = 0.1
    ppl_damage: float = 2.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choices(self.conditions, CONDITIONS, "condition")
        if not 0 < self.removed_fraction < 1:
            raise ValueError("removed_fraction must be in (0, 1)")
        if self.ppl_tolerance <= 0 or self.ppl_damage <= 1:
            raise ValueError("ppl_tolerance must be > 0 and ppl_damage > 1")


def condition_hooks(model, batch, site: causal.MassiveSite, cond: str, alpha: float) -> list:
    """The hooks of one condition (see module docstring)."""
    L, p = site.layer, [site.position]
    if cond == "flatten_gain":
        return causal.flatten_ffn_norm_gain(model, batch, L, p)
    if cond == "cap_ffn":
        return causal.cap_ffn_output(model, batch, L, p)
    if cond == "scale_product":
        return causal.scale_ffn_product(model, batch, L, p, alpha)
    if cond == "normalize_product":
        return causal.normalize_ffn_product(model, batch, L, p)
    if cond == "zero_dims":
        return causal.ablate_dims(model, batch, L, p, site.dims, "zero")
    if cond == "mean_dims":
        return causal.ablate_dims(model, batch, L, p, site.dims, "mean")
    raise ValueError(f"unknown condition {cond!r}; choose from {', '.join(CONDITIONS)}")


@dataclass
class Result:
    model: str
    bos: str
    site: causal.MassiveSite
    alpha: float
    removed_fraction: float
    ppl_tolerance: float
    ppl_damage: float
    measures: dict[str, dict[str, float]]  # condition (incl. "baseline") -> measure -> value

    def removed(self, cond: str) -> bool:
        base = self.measures["baseline"]["me_ratio"]
        return bool(self.measures[cond]["me_ratio"] <= self.removed_fraction * base)

    def ppl_ratio(self, cond: str) -> float:
        return self.measures[cond]["perplexity"] / self.measures["baseline"]["perplexity"]

    def to_dict(self) -> dict[str, Any]:
        lead = (
            "cap_ffn"
            if "cap_ffn" in self.measures
            else next(c for c in self.measures if c != "baseline")
        )
        base, after = self.measures["baseline"], self.measures[lead]
        return {
            "claim": CLAIM if lead == "cap_ffn" else f"{lead} removes the massive activation",
            "baseline": base,
            "intervened": {"condition": lead, **after},
            "verdict": {
                "holds": self.removed(lead),
                "me_ratio_fraction": after["me_ratio"] / base["me_ratio"],
                "rule": f"ME-layer norm ratio after / before <= {self.removed_fraction:g}",
            },
            "model": self.model,
            "bos": self.bos,
            "massive_site": self.site.to_dict(),
            "alpha": self.alpha,
            "conditions": {
                c: {
                    **m,
                    "me_ratio_fraction": m["me_ratio"] / base["me_ratio"],
                    "perplexity_ratio": self.ppl_ratio(c),
                    "removed": self.removed(c),
                }
                for c, m in self.measures.items()
            },
        }


def run(cfg: Config, model: LoadedModel | None = None) -> Result:
    """Measure every condition. No printing, no files."""
    model = model_for(cfg, model)
    batch = model.tokenize(cfg.load_prompts())
    site = causal.locate_massive(model, batch, cfg.layer, cfg.position)
    p, last = site.position, model.n_layers - 1
    metrics: dict[str, Any] = {
        "me_ratio": NormRatio(site.layer, p),
        "last_ratio": NormRatio(last, p),
    }
    if site.layer < last:
        metrics["sink"] = SinkMass(tuple(range(site.layer + 1, model.n_layers)), p)
    measures = {}
    for cond in ("baseline", *cfg.conditions):
        hooks = [] if cond == "baseline" else condition_hooks(model, batch, site, cond, cfg.alpha)
        vals = evaluate_metrics(model, batch, metrics, hooks)
        measures[cond] = {k: float(v.mean()) for k, v in vals.items()}
        measures[cond]["perplexity"] = perplexity(model, batch, hooks)
    return Result(
        model=model.name,
        bos=model.bos,
        site=site,
        alpha=cfg.alpha,
        removed_fraction=cfg.removed_fraction,
        ppl_tolerance=cfg.ppl_tolerance,
        ppl_damage=cfg.ppl_damage,
        measures=measures,
    )


def verdicts(result: Result) -> list[dict]:
    m = result.measures
    base = m["baseline"]
    out = []

    def ratio_text(c: str) -> str:
        return (
            f"ME-layer norm ratio {base['me_ratio']:.3g} -> {m[c]['me_ratio']:.3g}; "
            f"perplexity {base['perplexity']:.3g} -> {m[c]['perplexity']:.3g}"
        )

    claims = {
        "cap_ffn": CLAIM,
        "normalize_product": "Normalising the massive token's FFN intermediate product removes the "
        "massive activation (the FFN product carries it)",
        "scale_product": f"Scaling the massive token's FFN intermediate product by {result.alpha:g} "
        "removes the massive activation",
        "flatten_gain": "RMSNorm alignment is necessary: flattening the pre-FFN RMSNorm gain for the "
        "massive token removes the massive activation",
    }
    for c, claim in claims.items():
        if c in m:
            out.append({"claim": claim, "measured": ratio_text(c), "holds": result.removed(c)})
    if "mean_dims" in m:
        r = result.ppl_ratio("mean_dims")
        out.append(
            {
                "claim": "Setting the massive activations to their mean leaves perplexity unchanged "
                "(Sun et al.)",
                "measured": f"perplexity x{r:.3f} ({base['perplexity']:.3g} -> "
                f"{m['mean_dims']['perplexity']:.3g})",
                "holds": bool(abs(r - 1) <= result.ppl_tolerance),
            }
        )
    if "zero_dims" in m:
        r = result.ppl_ratio("zero_dims")
        out.append(
            {
                "claim": "Zeroing the massive activations hurts the model (perplexity up "
                f"x{result.ppl_damage:g} or more; Owen et al.: true for some models only)",
                "measured": f"perplexity x{r:.3g} ({base['perplexity']:.3g} -> "
                f"{m['zero_dims']['perplexity']:.3g})",
                "holds": bool(r >= result.ppl_damage),
            }
        )
    return out


def figures(result: Result) -> dict[str, Any]:
    conds = list(result.measures)
    base = result.measures["baseline"]
    fig = go.Figure()
    for key, label in (
        ("me_ratio", "ME-layer norm ratio"),
        ("last_ratio", "last-layer norm ratio"),
    ):
        fig.add_trace(go.Bar(x=conds, y=[result.measures[c][key] for c in conds], name=label))
    fig.update_layout(
        title=f"Massive-token norm ratio per condition — {result.model} (ME layer {result.site.layer})",
        yaxis_type="log",
        yaxis_title="‖h_p‖ / mean of others",
        barmode="group",
        template="plotly_white",
    )
    ppl = go.Figure(
        go.Bar(x=conds, y=[result.measures[c]["perplexity"] / base["perplexity"] for c in conds])
    )
    ppl.update_layout(
        title="Perplexity relative to the unmodified model",
        yaxis_type="log",
        yaxis_title="perplexity / baseline",
        template="plotly_white",
    )
    return {"norm_ratios": fig, "perplexity": ppl}


def summary(result: Result) -> str:
    s = result.site
    rows = [
        (
            c,
            m["me_ratio"],
            m["last_ratio"],
            m.get("sink", float("nan")),
            m["perplexity"],
            "-" if c == "baseline" else str(result.removed(c)),
        )
        for c, m in result.measures.items()
    ]
    return "\n".join(
        [
            f"model: {result.model}   ME layer {s.layer} (1-based {s.layer + 1}), position "
            f"{s.position}, dims {list(s.dims)[:6]}",
            fmt_table(
                ["condition", "ME ratio", "last ratio", "sink", "perplexity", "removed"], rows
            ),
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    return cli_main(NAME, Config, run, figures, summary, argv, description=__doc__)


if __name__ == "__main__":
    raise SystemExit(main())
