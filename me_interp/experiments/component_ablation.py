"""Component ablation at the ME layer: RMSNorm-only, FFN-only and residual-stream interventions.

Which part of the ME layer makes the massive activation, and does the model need it? Each condition
touches only the massive token ``p`` at the ME layer (both measured by the ME-layer probe); one
forward per condition measures, per prompt, the norm ratio ``R = ‖h_p‖ / mean_{t≠p}‖h_t‖`` at the
ME-layer output and at the last layer, the attention of the layers after the ME layer to ``p`` (mean
over heads and queries ``q > p``) and the next-token NLL of every real token (perplexity):

* ``flatten_gain``      — RMSNorm-only: the pre-FFN norm output of ``p`` is ``ĥ_p ⊙ mean(w)``;
* ``cap_ffn``           — FFN-only: ``‖FFN_p‖`` capped at the median FFN-output norm of the others;
* ``scale_product``     — FFN-only: the intermediate product ``act(W_gate x) ⊙ W_up x`` of ``p`` × α
  (a dose, measured and shown; no claim);
* ``normalize_product`` — FFN-only: that product rescaled to the other tokens' mean norm;
* ``zero_dims``         — residual: the massive dims of ``p`` at the ME-layer output set to 0
  (Owen et al.: ruins some models, not others);
* ``mean_dims``         — residual: those dims set to their mean over the prompts (Sun et al.:
  perplexity unchanged).

The specs (:data:`SPECS`; kinds in brackets) are judged where the edit did not write: on the **last
layer's** norm ratio (``R − 1`` of the massive token falls to at most the ``removed`` fraction of the
unedited excess) and on **perplexity** (the ``ppl_damage`` and ``ppl_unchanged`` rules),
bootstrapped over prompts:

* ``cap_site`` [sanity] — the cap lowers the ratio at the capped site itself (by construction);
* ``cap_removes`` [control] — the cap leaves no massive token at the last layer: the precondition
  of ``cap_ffn_hurts`` (which is not applicable when the cap's point estimate leaves more). It was
  the claim ``cap_ffn`` ("the FFN creates it"), a duplicate of ``activation_patching.ffn_writes`` and
  ``me_layer.ffn_creates``;
* ``flatten_gain`` [claim] — RMSNorm-only: flattening the gain leaves no massive token downstream;
* ``cap_ffn_hurts`` [claim] — the model needs it: the cap multiplies perplexity by ``ppl_damage``;
* ``mean_dims_harmless`` [control] — Sun et al.'s mean ablation leaves perplexity unchanged: a
  near-identity edit (its size ``‖Δ‖ / ‖h_p‖`` at the ME-layer output is in the details), so it is
  the control of ``zero_dims_hurts``, not evidence;
* ``zero_dims_hurts`` [claim] — Owen et al.'s zero ablation multiplies perplexity by ``ppl_damage``
  (true for some models only; the zeroed share ``‖h_p[D]‖ / ‖h_p‖`` is in the details).

``normalize_product`` and ``scale_product`` are measured and shown, with no spec: ``W_down`` is
linear, so rescaling the product ``a_p`` is rescaling the FFN output ``W_down a_p`` — the cap again,
with another factor (the former ``normalize_product`` claim was a duplicate of ``cap_ffn``).

    python -m me_interp.experiments.component_ablation
    python -m me_interp.experiments.component_ablation --alpha 0.5 --conditions cap_ffn zero_dims
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import plotly.graph_objects as go
import torch

from me_interp import claims, evaluation, names
from me_interp.evaluation import logits_nll
from me_interp.interventions import causal
from me_interp.loading.loaded import Batch, LoadedModel
from me_interp.patching import NormRatio, SinkMass
from me_interp.probes.activations import Activations
from me_interp.probes.batching import record
from me_interp.probes.site import Site, locate
from me_interp.study import Experiment, SiteConfig, checked, command, model_for
from me_interp.terminal import fmt_table

NAME = "component_ablation"
CONDITIONS: tuple[str, ...] = (
    "flatten_gain",
    "cap_ffn",
    "scale_product",
    "normalize_product",
    "zero_dims",
    "mean_dims",
)
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


def _why(key: str):
    """Why spec ``key`` does not apply (``None`` when it does)."""

    def why(r: Result) -> str | None:
        s, cond = r.site, CLAIM_CONDITION[key]
        if not s.massive:
            return s.why_not
        if cond not in r.per_prompt:
            return f"the condition {cond} was not run (--conditions)"
        last = s.layer == r.n_layers - 1
        if key == "cap_removes" and last:
            return "the ME layer is the last layer: its ratio is the capped site itself"
        if key == "cap_ffn_hurts":
            ratio = "me_ratio" if last else "last_ratio"
            frac = r.excess(cond, ratio)
            if not frac <= claims.threshold("removed"):
                return (
                    f"the cap did not remove the massive activation "
                    f"{'at the ME layer' if last else 'downstream'} ((R − 1) edited / unedited "
                    f"= {frac:.3g} > {claims.threshold('removed'):g}, threshold 'removed'): the "
                    "perplexity change is not that of a model without it"
                )
        if key == "mean_dims_harmless" and r.same_prefix:
            return (
                f"every prompt has the same tokens up to position {s.position}, so the massive "
                "token's state is the same in every prompt and its mean is each prompt's own value: "
                "the edit is the identity (use prompts with different first tokens)"
            )
        return None

    return why


def _ratio_stat(key: str):
    ratio = "me_ratio" if key == "cap_site" else "last_ratio"

    def stat(r: Result) -> claims.Sample:
        m, base = r.per_prompt[CLAIM_CONDITION[key]], r.per_prompt["baseline"]
        rows = torch.stack([m[ratio], base[ratio]], 1).double().numpy()
        return claims.Sample(rows, claims.excess_stat)

    return stat


def _ppl_stat_of(key: str, signed: bool):
    def stat(r: Result) -> claims.Sample:
        m, base = r.per_prompt[CLAIM_CONDITION[key]], r.per_prompt["baseline"]
        rows = torch.stack([base["n_tokens"], base["nll_sum"], m["nll_sum"]], 1).double().numpy()
        return claims.Sample(rows, evaluation.PPL_CHANGE if signed else evaluation.PPL_RATIO)

    return stat


def _details(key: str):
    def details(r: Result) -> str:
        s, cond = r.site, CLAIM_CONDITION[key]
        out = (
            f"{cond} at ME layer {s.layer} (1-based {s.layer + 1}), position {s.position}; "
            f"n = {len(r.per_prompt['baseline']['me_ratio'])} prompts of <= "
            f"{r.prompts.max_tokens} tokens"
        )
        if key in ("cap_site", "cap_removes", "flatten_gain"):
            ratio = "me_ratio" if key == "cap_site" else "last_ratio"
            out += (
                f"; {'ME-layer' if ratio == 'me_ratio' else 'last-layer'} R "
                f"{r.mean('baseline', ratio):.4g} -> {r.mean(cond, ratio):.4g} (ME-layer R "
                f"{r.mean('baseline', 'me_ratio'):.4g} -> {r.mean(cond, 'me_ratio'):.4g})"
            )
        else:
            out += (
                f"; perplexity {r.perplexity('baseline'):.4g} -> {r.perplexity(cond):.4g} "
                f"(x{r.ppl_ratio(cond):.3g}); last-layer R {r.mean('baseline', 'last_ratio'):.4g} "
                f"-> {r.mean(cond, 'last_ratio'):.4g}"
            )
        if cond in r.edit_size:
            e = np.asarray(r.edit_size[cond])
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
        control="mean_dims (the same token edited without removing the activation)",
        kind="control",
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
        "token (which removes it, cap_removes) raises perplexity by the 'ppl_damage' factor or more",
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
        "Zeroing the massive activations hurts the model: perplexity rises by the 'ppl_damage' "
        "factor or more",
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


def condition_hooks(model, batch, site: Site, cond: str, alpha: float, acts=None):
    """The hooks of one condition (see module docstring); ``acts``: an :class:`~me_interp.probes.activations.Activations` of the unedited run."""
    L, p = site.layer, [site.position]
    if cond == "flatten_gain":
        return causal.flatten_ffn_norm_gain(model, batch, L, p, acts=acts)
    if cond == "cap_ffn":
        return causal.cap_ffn_output(model, batch, L, p, acts=acts)
    if cond == "scale_product":
        return causal.scale_ffn_product(model, batch, L, p, alpha, acts=acts)
    if cond == "normalize_product":
        return causal.normalize_ffn_product(model, batch, L, p, acts=acts)
    if cond == "zero_dims":
        return causal.ablate_dims(model, batch, L, p, site.dims, "zero")
    if cond == "mean_dims":
        return causal.ablate_dims(model, batch, L, p, site.dims, "mean", acts=acts)
    raise ValueError(f"unknown condition {cond!r}; choose from {', '.join(CONDITIONS)}")


def _capture_names(layer: int) -> list[str]:
    """The unedited activations every condition's factory reads (one shared capture)."""
    return [
        names.site("ffn_normalized", layer),
        names.ffn_out(layer),
        names.site("ffn_act", layer),
        names.resid_post(layer),
    ]


def measure(
    model: LoadedModel, batch: Batch, metrics: dict[str, Any], fwd_hooks: Sequence = ()
) -> dict[str, torch.Tensor]:
    """One forward: every metric per prompt, and the per-prompt NLL sum and token count."""
    acts = Activations(model, batch, [n for m in metrics.values() for n in m.hook_names()])
    logits = record(model, batch, [acts], fwd_hooks=fwd_hooks, logits=True)
    nll, valid = logits_nll(logits, batch.tokens, batch.attention_mask)
    mask = batch.attention_mask.bool()
    out = {k: m(acts, mask).float().cpu() for k, m in metrics.items()}
    out["nll_sum"] = (nll.double() * valid).sum(-1)
    out["n_tokens"] = valid.sum(-1).double()
    return out


@dataclass
class Result:
    model: str
    bos: str
    site: Site
    prompts: causal.PromptBatch
    n_layers: int
    alpha: float
    per_prompt: dict[str, dict[str, torch.Tensor]]  # condition (incl. "baseline") -> measure
    same_prefix: bool  # every prompt has the same tokens up to p: mean_dims is then the identity
    edit_size: dict[str, list[float]]  # zero_dims / mean_dims -> per prompt ‖Δ‖ / ‖h_p‖ (ME layer)
    seed: int = 0

    def mean(self, cond: str, key: str) -> float:
        return float(self.per_prompt[cond][key].mean())

    def perplexity(self, cond: str) -> float:
        m = self.per_prompt[cond]
        return float(torch.exp(m["nll_sum"].sum() / m["n_tokens"].sum()))

    def ppl_ratio(self, cond: str) -> float:
        return self.perplexity(cond) / self.perplexity("baseline")

    def excess(self, cond: str, key: str) -> float:
        """``excess_fraction`` of the prompt-mean ratio ``key`` (``me_ratio`` or ``last_ratio``)."""
        return claims.excess_fraction(self.mean(cond, key), self.mean("baseline", key))

    def to_dict(self) -> dict[str, Any]:
        conds = list(self.per_prompt)
        return {
            "model": self.model,
            "bos": self.bos,
            "massive_site": self.site.to_dict(),
            "prompts": self.prompts.to_dict(),
            "alpha": self.alpha,
            "same_prefix": self.same_prefix,
            "edit_size": self.edit_size,
            "conditions": {
                c: {
                    "me_ratio": self.mean(c, "me_ratio"),
                    "last_ratio": self.mean(c, "last_ratio"),
                    **({"sink": self.mean(c, "sink")} if "sink" in self.per_prompt[c] else {}),
                    "perplexity": self.perplexity(c),
                    "me_excess_fraction": self.excess(c, "me_ratio"),
                    "last_excess_fraction": self.excess(c, "last_ratio"),
                    "perplexity_ratio": self.ppl_ratio(c),
                }
                for c in conds
            },
            "per_prompt": {
                c: {k: v.tolist() for k, v in m.items()} for c, m in self.per_prompt.items()
            },
        }


def run(cfg: Config, model: LoadedModel | None = None) -> Result:
    """Measure every condition. No printing, no files.

    Raises:
        claims.NotApplicable: no massive activation on this model and no ``layer`` given.
    """
    model = model_for(cfg, model)
    pb = causal.prompt_batch(model, cfg.load_prompts(), cfg.max_tokens, cfg.max_prompts)
    site = locate(model, pb.batch, layer=cfg.layer, position=cfg.position, seed=cfg.seed)
    site.require("pass --layer to intervene anyway")
    p, L, last = site.position, site.layer, model.n_layers - 1
    pb = pb.at_least(p + 2)  # a token after the massive one
    batch = pb.batch
    metrics: dict[str, Any] = {"me_ratio": NormRatio(L, p), "last_ratio": NormRatio(last, p)}
    if L < last:
        metrics["sink"] = SinkMass(tuple(range(L + 1, model.n_layers)), p)
    acts = Activations(model, batch, _capture_names(L))
    record(model, batch, [acts], last_layer=acts.last_layer, max_tokens=None)
    per_prompt = {"baseline": measure(model, batch, metrics)}
    h = acts[names.resid_post(L)].float().cpu()[:, p]  # [B d]
    dims = list(site.dims)
    delta = {  # what each residual edit changes in h_p (the edit size is its control)
        "zero_dims": h[:, dims],
        "mean_dims": h[:, dims] - h[:, dims].mean(0, keepdim=True),
    }
    edit_size = {
        c: (d.norm(dim=-1) / h.norm(dim=-1)).tolist()
        for c, d in delta.items()
        if c in cfg.conditions
    }
    for cond in cfg.conditions:
        hooks = condition_hooks(model, batch, site, cond, cfg.alpha, acts)
        per_prompt[cond] = measure(model, batch, metrics, hooks)
    return Result(
        model=model.name,
        bos=model.bos,
        site=site,
        prompts=pb,
        n_layers=model.n_layers,
        alpha=cfg.alpha,
        per_prompt=per_prompt,
        same_prefix=bool((batch.tokens[:, : p + 1] == batch.tokens[:1, : p + 1]).all()),
        edit_size=edit_size,
        seed=cfg.seed,
    )


def figures(result: Result) -> dict[str, Any]:
    conds = list(result.per_prompt)
    fig = go.Figure()
    for key, label in (
        ("me_ratio", "ME-layer norm ratio"),
        ("last_ratio", "last-layer norm ratio"),
    ):
        fig.add_trace(go.Bar(x=conds, y=[result.mean(c, key) for c in conds], name=label))
    fig.update_layout(
        title=f"Massive-token norm ratio per condition — {result.model} (ME layer {result.site.layer})",
        yaxis_type="log",
        yaxis_title="‖h_p‖ / mean of others",
        barmode="group",
        template="plotly_white",
    )
    ppl = go.Figure(go.Bar(x=conds, y=[result.ppl_ratio(c) for c in conds]))
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
            result.mean(c, "me_ratio"),
            result.mean(c, "last_ratio"),
            result.mean(c, "sink") if "sink" in m else float("nan"),
            result.perplexity(c),
            "-" if c == "baseline" else result.excess(c, "last_ratio"),
        )
        for c, m in result.per_prompt.items()
    ]
    return "\n".join(
        [
            f"model: {result.model}   ME layer {s.layer} (1-based {s.layer + 1}), position "
            f"{s.position}, dims {list(s.dims)[:6]}; {len(result.prompts.indices)} prompts",
            fmt_table(
                ["condition", "ME ratio", "last ratio", "sink", "perplexity", "last excess left"],
                rows,
            ),
        ]
    )


EXPERIMENT = Experiment(
    NAME, Config, run, SPECS, figures, summary, __doc__, key_figures=("norm_ratios",)
)
main = command(EXPERIMENT)


if __name__ == "__main__":
    raise SystemExit(main())
