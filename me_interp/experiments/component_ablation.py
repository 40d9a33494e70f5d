"""Component ablation at the ME layer: RMSNorm-only, FFN-only and residual-stream interventions.

Which part of the ME layer makes the massive activation, and does the model need it? Each condition
touches only the massive token ``p`` at the ME layer (both measured by the ME-layer probe); one
forward per condition measures, per prompt, the norm ratio ``R = ‖h_p‖ / mean_{t≠p}‖h_t‖`` at the
ME-layer output and at the last layer, the attention of the layers after the ME layer to ``p`` (mean
over heads and queries ``q > p``) and the next-token NLL of every real token (perplexity):

``flatten_gain`` (RMSNorm-only), ``cap_ffn``, ``scale_product`` (a dose, no claim),
``normalize_product`` (FFN-only), ``zero_dims`` (Owen et al.: ruins some models, not others) and
``mean_dims`` (Sun et al.: perplexity unchanged), each defined in
:mod:`me_interp.interventions.conditions`.

The claims are judged where the edit did not write (the last layer's norm ratio, perplexity); one
about a removal only where the edited token is ordinary afterwards (:mod:`me_interp.probes.removal`).
``normalize_product`` and ``scale_product`` have no claim: ``W_down`` is linear, so rescaling the
product is the cap again, with another factor.

    python -m me_interp.experiments.component_ablation
    python -m me_interp.experiments.component_ablation --alpha 0.5 --conditions cap_ffn zero_dims
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from me_interp import claims, evaluation, names, plotting
from me_interp.interventions.causal import PromptsUsed
from me_interp.interventions.conditions import (
    COMPONENTS,
    Conditions,
    condition_hooks,
    edit_sizes,
    unedited_names,
)
from me_interp.loading.loaded import LoadedModel
from me_interp.patching import NormRatio, SinkMass
from me_interp.probes.activations import Activations
from me_interp.probes.batching import record
from me_interp.probes.site import Site
from me_interp.probes.to_position import read_metrics
from me_interp.study.cli import command
from me_interp.study.config import SiteConfig, checked
from me_interp.study.experiment import Experiment, prepare, prompt_inputs
from me_interp.study.result import Headed, RunHeader, run_header
from me_interp.terminal import fmt_table

NAME = "component_ablation"
CONDITIONS = COMPONENTS
_LAST = (
    "(R − 1) of the massive token at the last layer, edited over unedited "
    "(R = ‖h_p‖ / mean_{t≠p}‖h_t‖; ratio of prompt means; 0 = as ordinary as the other tokens)"
)
_PPL = "perplexity of the prompts, edited over unedited (token-weighted over the resampled prompts)"
#: condition each spec is about
CLAIM_CONDITION = {
    "cap_site": "cap_ffn",
    "cap_removes": "cap_ffn",
    "flatten_gain": "flatten_gain",
    "cap_ffn_hurts": "cap_ffn",
    "mean_dims_harmless": "mean_dims",
    "zero_dims_hurts": "zero_dims",
}
_REMOVALS = {"cap_ffn_hurts": "the cap", "zero_dims_hurts": "zeroing the massive dims"}


@dataclass(frozen=True)
class Condition:
    """One condition's per-prompt measurements (``baseline``: the unedited run).

    Attributes:
        me_ratio, last_ratio: ``p``'s norm ratio at the ME-layer and the last-layer output.
        sink: the attention of the layers after the ME layer to ``p`` (empty at the last layer).
        nll_sum, n_tokens: the next-token NLL sum and the count of predicted tokens.
        edit_size: ``‖Δ‖ / ‖h_p‖`` of a residual edit at the ME-layer output (``zero_dims``,
            ``mean_dims``; empty for the others).
    """

    name: str
    me_ratio: list[float]
    last_ratio: list[float]
    sink: list[float]
    nll_sum: list[float]
    n_tokens: list[float]
    edit_size: list[float]

    def ratio(self, last: bool) -> np.ndarray:
        return np.asarray(self.last_ratio if last else self.me_ratio, dtype=np.float64)

    @property
    def perplexity(self) -> float:
        return float(np.exp(np.sum(self.nll_sum) / np.sum(self.n_tokens)))


@dataclass(frozen=True)
class Result(Headed, Conditions):
    """Every condition and what it did (``header``: the ME layer, position ``p`` and dims).

    Attributes:
        why_not: why the claims about a massive activation at the layer do not apply (``None``).
        conditions: ``baseline`` first, then every condition run.
        same_prefix: every prompt has the same tokens up to ``p`` (``mean_dims`` is the identity).
    """

    header: RunHeader
    prompts: PromptsUsed
    why_not: str | None
    n_layers: int
    alpha: float
    conditions: list[Condition]
    same_prefix: bool

    def ppl_ratio(self, name: str) -> float:
        return self.of(name).perplexity / self.of("baseline").perplexity


def _why(key: str):
    """Why spec ``key`` does not apply (``None`` when it does)."""

    def why(r: Result) -> str | None:
        h, name = r.header, CLAIM_CONDITION[key]
        if why := r.why_not or r.not_run(name):
            return why
        last = h.layer == r.n_layers - 1
        if key == "cap_removes" and last:
            return "the ME layer is the last layer: its ratio is the capped site itself"
        if key in _REMOVALS:
            return r.not_removed(name, _REMOVALS[key], at_last=not last)
        if key == "mean_dims_harmless" and r.same_prefix:
            return (
                f"every prompt has the same tokens up to position {h.position}, so the massive "
                "token's state is the same in every prompt and its mean is each prompt's own value: "
                "the edit is the identity (use prompts with different first tokens)"
            )
        return None

    return why


def _ratio_stat(key: str):
    def stat(r: Result) -> claims.Sample:
        last = key != "cap_site"
        rows = np.stack([r.of(CLAIM_CONDITION[key]).ratio(last), r.of("baseline").ratio(last)], 1)
        return claims.Sample(rows, claims.excess_stat)

    return stat


def _ppl_stat_of(key: str, signed: bool):
    def stat(r: Result) -> claims.Sample:
        m, base = r.of(CLAIM_CONDITION[key]), r.of("baseline")
        rows = np.stack([base.n_tokens, base.nll_sum, m.nll_sum], 1).astype(np.float64)
        return claims.Sample(rows, evaluation.PPL_CHANGE if signed else evaluation.PPL_RATIO)

    return stat


def _details(key: str):
    def details(r: Result) -> str:
        h, name = r.header, CLAIM_CONDITION[key]
        base, c = r.of("baseline"), r.of(name)
        out = (
            f"{name} at ME layer {h.layer} (1-based {h.layer + 1}), position {h.position}; "
            f"n = {len(base.me_ratio)} prompts of <= {r.prompts.max_tokens} tokens; R of p at the "
            f"ME layer {base.ratio(False).mean():.4g} -> {c.ratio(False).mean():.4g}, at the last "
            f"layer {base.ratio(True).mean():.4g} -> {c.ratio(True).mean():.4g}"
        )
        if key not in ("cap_site", "cap_removes", "flatten_gain"):
            out += (
                f"; perplexity {base.perplexity:.4g} -> {c.perplexity:.4g} "
                f"(x{r.ppl_ratio(name):.3g})"
            )
        if c.edit_size:
            e = np.asarray(c.edit_size)
            out += (
                f"; edit size ‖Δ‖ / ‖h_p‖ at the ME-layer output {e.mean():.3g} (mean over prompts; "
                f"max {e.max():.3g})"
            )
            if key == "mean_dims_harmless":
                out += " — a near-identity edit: a control, not evidence"
        return out

    return details


def _spec(key: str, section: str, statement: str, statistic: str, op: str, thr: str, **kw):
    stat = _ratio_stat(key) if thr == "removed" else _ppl_stat_of(key, signed=op == "|x|<")
    return claims.Spec(
        f"component_ablation.{key}",
        section,
        statement,
        statistic,
        op,
        thr,
        stat=stat,
        massive_state=thr == "removed",  # R of the massive token: a function of its prefix
        applies=_why(key),
        details=_details(key),
        **kw,
    )


SPECS: tuple[claims.Spec, ...] = (
    _spec(
        "cap_site",
        "§2.1",
        "Capping the massive token's FFN output at the ME layer removes its norm ratio at that "
        "layer (true by construction: the capped site itself)",
        _LAST.replace("at the last layer", "at the ME-layer output"),
        "<=",
        "removed",
        control="the unedited run",
        kind="sanity",
    ),
    _spec(
        "cap_removes",
        "§2.1, §3 (FFN-only intervention)",
        "Control for cap_ffn_hurts: capping the massive token's FFN output at the ME layer at the "
        "other tokens' median norm leaves no massive token at the last layer, so the perplexity "
        "after the cap is that of the model without its massive activation",
        _LAST,
        "<=",
        "removed",
        kind="control",
        control="mean_dims (the same token edited without removing the activation)",
    ),
    _spec(
        "flatten_gain",
        "§2.2, §3 (RMSNorm-only intervention)",
        "RMSNorm alignment is necessary: flattening the pre-FFN RMSNorm gain for the massive token "
        "(ĥ_p ⊙ mean(w)) leaves no massive token at the last layer",
        _LAST,
        "<=",
        "removed",
        control="cap_removes (the FFN-only removal)",
    ),
    _spec(
        "cap_ffn_hurts",
        "§2.1; Owen et al. 2025",
        "The model needs the massive activation: capping the ME layer's FFN output at the massive "
        "token (which leaves it an ordinary token) raises perplexity by the 'ppl_damage' factor "
        "or more",
        _PPL,
        ">=",
        "ppl_damage",
        control="mean_dims (an edit of the same token that keeps the activation)",
    ),
    _spec(
        "mean_dims_harmless",
        "§4; Sun et al. 2024",
        "Control: setting the massive activations to their mean over the prompts (a near-identity "
        "edit, its size in the details) leaves perplexity unchanged",
        _PPL + " − 1 (signed; judged by its size)",
        "|x|<",
        "ppl_unchanged",
        control="zero_dims (the same dims set to 0)",
        kind="control",
    ),
    _spec(
        "zero_dims_hurts",
        "§4; Owen et al. 2025 (true for some models only)",
        "Zeroing the massive activations (which leaves the token ordinary) hurts the model: "
        "perplexity rises by the 'ppl_damage' factor or more",
        _PPL,
        ">=",
        "ppl_damage",
        control="mean_dims",
    ),
)
SPEC = claims.index(SPECS)


@dataclass(frozen=True)
class Config(SiteConfig):
    """Component-ablation settings.

    Attributes:
        conditions: the interventions to run, each separately; a claim whose condition is not run
            is not applicable.
        alpha: factor α of ``scale_product`` (the FFN intermediate product of ``p`` × α).
        max_tokens: prompts are cut to their first ``max_tokens`` tokens (>= 2); perplexity is
            over the tokens kept.
        max_prompts: how many prompts to use, spread evenly over the prompt list (``None``: all).
            One full forward (with logits) per condition; the default keeps the bundled model's run
            around 30 s on two CPU cores.
    """

    conditions: tuple[str, ...] = checked(CONDITIONS, choices=CONDITIONS, nonempty=True)
    alpha: float = checked(0.1, ge=0, finite=True)  # below 0 flips the FFN product's sign
    max_tokens: int = checked(32, ge=2)
    max_prompts: int | None = checked(32, ge=1)


def measure(name: str, model, batch, metrics, hooks=(), edit_size=()) -> Condition:
    """One forward under ``hooks``: condition ``name``'s per-prompt measurements."""
    got, nll_sum, n_tokens = read_metrics(model, batch, metrics, hooks)
    return Condition(
        name,
        got["me_ratio"],
        got["last_ratio"],
        got.get("sink", []),
        nll_sum,
        n_tokens,
        list(edit_size),
    )


def run(cfg: Config, model: LoadedModel | None = None, site: Site | None = None) -> Result:
    """Measure every condition. No printing, no files.

    Raises:
        claims.NotApplicable: no massive activation on this model and no ``layer`` given.
    """
    model, site = prepare(EXPERIMENT, cfg, model, site)
    pb = site.inputs
    site.require("pass --layer to intervene anyway")
    p, L, last = site.position, site.layer, model.n_layers - 1
    pb = pb.at_least(p + 2)  # a token after the massive one
    batch = pb.batch
    metrics: dict[str, Any] = {"me_ratio": NormRatio(L, p), "last_ratio": NormRatio(last, p)}
    if L < last:
        metrics["sink"] = SinkMass(tuple(range(L + 1, model.n_layers)), p)
    acts = Activations(model, batch, unedited_names(L))
    record(model, batch, [acts], last_layer=acts.last_layer, max_tokens=None)
    conds = [measure("baseline", model, batch, metrics)]
    h = acts[names.resid_post(L)].float().cpu()[:, p]  # [B d]
    edit_size = edit_sizes(h, site.dims, cfg.conditions)  # the residual edits' size: their control
    for cond in cfg.conditions:
        hooks = condition_hooks(model, batch, cond, L, p, site.dims, cfg.alpha, acts)
        conds.append(measure(cond, model, batch, metrics, hooks, edit_size.get(cond, [])))
    header = run_header(cfg, model, len(batch), site)
    return Result(
        header, pb.used(), site.why_not, model.n_layers, cfg.alpha, conds, pb.same_prefix(p)
    )


def figures(result: Result) -> dict[str, Any]:
    names_ = [c.name for c in result.conditions]
    ratios = {
        "ME-layer norm ratio": [float(c.ratio(False).mean()) for c in result.conditions],
        "last-layer norm ratio": [float(c.ratio(True).mean()) for c in result.conditions],
    }
    h = result.header
    return {
        "norm_ratios": plotting.grouped_bars(
            names_,
            ratios,
            f"Massive-token norm ratio per condition — {h.model} (ME layer {h.layer})",
            "‖h_p‖ / mean of others",
        ),
        "perplexity": plotting.grouped_bars(
            names_,
            {"perplexity": [result.ppl_ratio(n) for n in names_]},
            "Perplexity relative to the unmodified model",
            "perplexity / baseline",
        ),
    }


def summary(result: Result) -> str:
    h = result.header
    rows = [
        (
            c.name,
            float(c.ratio(False).mean()),
            float(c.ratio(True).mean()),
            float(np.mean(c.sink)) if c.sink else float("nan"),
            c.perplexity,
            "-" if c.name == "baseline" else result.excess(c.name),
        )
        for c in result.conditions
    ]
    head = ["condition", "ME ratio", "last ratio", "sink", "perplexity", "last excess left"]
    return "\n".join(
        [
            f"model: {h.model}   ME layer {h.layer} (1-based {h.layer_1based}), position "
            f"{h.position}, dims {list(h.dims)[:6]}; {h.n_prompts} prompts",
            fmt_table(head, rows),
        ]
    )


EXPERIMENT = Experiment(
    NAME,
    Config,
    run,
    SPECS,
    figures,
    summary,
    __doc__,
    key_figures=("norm_ratios",),
    inputs=prompt_inputs,
)
main = command(EXPERIMENT)


if __name__ == "__main__":
    raise SystemExit(main())
