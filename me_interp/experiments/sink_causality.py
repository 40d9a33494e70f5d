"""Sink causality: remove the massive activation at the ME layer and measure the attention sink downstream.

The paper (paper.md §2, claim 6) says the massive activation *causes* the attention sink on its token.
This experiment removes it at the ME layer (measured with the ME-layer probe) and compares, at every
layer and head, the attention of the real queries ``q > p`` to the massive position ``p`` and the
attention entropy with the unmodified run — per prompt, one forward per condition:

* ``remove_ffn``  — the ME layer's FFN output of token ``p`` set to the other tokens' mean FFN output
  (the massive activation is never written);
* ``remove_dims`` — token ``p``'s massive dims of the ME-layer output set to the other tokens' mean;
* ``remove_all``  — token ``p``'s whole ME-layer output set to the other tokens' mean;
* ``patch_other`` — control: token ``p``'s ME-layer output replaced by that of the next prompt
  (still massive, from another input): the sink should survive.

*Sink heads* are the heads of the layers after the ME layer whose unmodified mean attention to ``p``
reaches the ``sink_attention`` threshold of :data:`me_interp.claims.THRESHOLDS`. Each condition is
one spec (:data:`SPECS`), judged on the sink heads' attention to ``p`` after the condition over
before (``1 − ratio of prompt means``, bootstrapped over prompts); each is worded as what it
measures (which edit, which drop), not as "the massive activation causes the sink":

* ``remove_ffn`` [claim] — the drop reaches the ``relative_drop`` threshold. Where the ME layer's FFN
  output *is* the massive token's whole state (cosine > 0.99, 95–105 % of the norm:
  ``probes.ffn.ffn_share``) the edit is ``remove_all`` and the claim is not applicable;
* ``remove_all`` [sanity] — the same on the whole state: every later state of ``p`` is then an
  ordinary token's, so the sink heads lose it nearly by construction (it mirrors
  ``activation_patching.state_causes_sink``);
* ``remove_dims`` [claim] — the same with only the massive dims reset: do the massive dims alone
  carry the sink?
* ``patch_other`` [control] — the sink changes by less than ``relative_drop``; not applicable when
  every prompt has the same tokens up to ``p`` (then the swap is the identity: the trap of paper.md
  §4).

A removal spec is not applicable when its condition did not remove the massive activation (the
``removed`` rule on the ME-layer norm ratio), or when there is no later layer or no sink head.

    python -m me_interp.experiments.sink_causality
    python -m me_interp.experiments.sink_causality --model synthetic:planted --prompts p.txt
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from me_interp import claims, names, plotting
from me_interp.interventions import causal
from me_interp.loading.loaded import Batch, LoadedModel
from me_interp.probes.activations import Activations
from me_interp.probes.attention import attention_entropy
from me_interp.probes.batching import record
from me_interp.probes.ffn import FfnShare, ffn_share
from me_interp.probes.norms import ratio_to_others
from me_interp.probes.site import Site, locate
from me_interp.study import Experiment, SiteConfig, checked, command, model_for
from me_interp.terminal import fmt_table

NAME = "sink_causality"
CONDITIONS: tuple[str, ...] = ("remove_ffn", "remove_dims", "remove_all", "patch_other")
CONTROLS: tuple[str, ...] = ("patch_other",)
_SINK = (
    "the sink heads' mean attention to p after the condition over before (ratio of prompt means)"
)


def _why(key: str):
    """Why the spec of condition ``key`` does not apply (``None`` when it does)."""

    def why(r: Result) -> str | None:
        s = r.site
        if not s.massive:
            return s.why_not
        if s.layer + 1 >= r.n_layers:
            return f"the ME layer {s.layer} is the last layer: no later layer, no downstream sink"
        w = s.sink_why_not(r.sink_heads)
        if w is not None:
            return w
        if key not in r.measures:
            return f"the condition {key} was not run (--conditions)"
        if key in CONTROLS:
            if r.same_prefix:
                return (
                    f"every prompt has the same tokens up to position {s.position}, so the "
                    "swapped-in state is the prompt's own (use prompts with different first tokens)"
                )
            return None
        frac = r.removal_fraction(key)
        if not frac <= claims.threshold("removed"):
            return (
                f"the condition did not remove the massive activation: ME-layer (R − 1) after / "
                f"before = {frac:.3g} > {claims.threshold('removed'):g} (threshold 'removed')"
            )
        if key == "remove_ffn" and r.ffn.is_state():
            return (
                f"{r.ffn.text()}: the FFN output is the state itself, so removing it is removing "
                "the whole state — the sanity check remove_all"
            )
        return None

    return why


def _stat(key: str):
    def stat(r: Result) -> claims.Sample:
        after = r.sink_per_prompt(key).double().numpy()
        before = r.sink_per_prompt("baseline").double().numpy()
        return claims.Sample(np.stack([after, before], 1), _drop_stat)

    return stat


def _details(key: str):
    def details(r: Result) -> str:
        s, base, m = r.site, r.measures["baseline"], r.measures[key]
        before, after = r.sink_per_prompt("baseline"), r.sink_per_prompt(key)
        out = (
            f"{len(r.sink_heads())} sink heads after ME layer {s.layer} (1-based {s.layer + 1}), "
            f"position {s.position}: attention {float(before.mean()):.3g} -> "
            f"{float(after.mean()):.3g}; entropy after the ME layer "
            f"{float(r.entropy_after_me('baseline').mean()):.3g} -> "
            f"{float(r.entropy_after_me(key).mean()):.3g} nats; ME-layer norm ratio "
            f"{float(base.me_ratio.mean()):.4g} -> {float(m.me_ratio.mean()):.4g}; n = "
            f"{len(before)} prompts"
        )
        others = [c for c in r.measures if c not in ("baseline", key)]
        if others:
            out += "; drops of the other conditions: " + ", ".join(
                f"{c} {r.drop(c):.3g}" for c in others
            )
        if key in ("remove_ffn", "remove_all"):
            out += f"; {r.ffn.text()}"
        return out

    return details


def _spec(key: str, section: str, statement: str, kind: str = "claim", **kw) -> claims.Spec:
    return claims.Spec(
        f"sink_causality.{key}",
        section,
        statement,
        kw.pop("statistic", "1 − " + _SINK),
        kw.pop("op", ">="),
        "relative_drop",
        kind=kind,
        stat=_stat(key),
        applies=_why(key),
        details=_details(key),
        **kw,
    )


SPECS: tuple[claims.Spec, ...] = (
    _spec(
        "remove_ffn",
        "§2.6",
        "Setting the ME layer's FFN output at the massive token to the other tokens' mean (so the "
        "massive activation is never written) makes the later sink heads drop their attention to "
        "that token (applies only where the FFN output is not the token's whole state; there the "
        "edit is remove_all)",
        control="the unmodified run; the patch_other control; remove_dims (in the details)",
    ),
    _spec(
        "remove_all",
        "§2.6",
        "Replacing the massive token's whole ME-layer output by the other tokens' mean makes the "
        "later sink heads drop their attention to it (nearly true by construction: every later "
        "state of p is then an ordinary token's; a sanity check, mirroring "
        "activation_patching.state_causes_sink)",
        kind="sanity",
        control="the unmodified run; the patch_other control",
    ),
    _spec(
        "remove_dims",
        "§2.6, §4 (massive dims)",
        "Resetting only the massive dims of the massive token's ME-layer output (to the other "
        "tokens' mean) makes the later sink heads drop their attention to it: the massive dims "
        "alone carry the sink",
        control="remove_all (the whole state, in the details)",
    ),
    _spec(
        "patch_other",
        "§2.4 (directional invariance)",
        "Control: the sink does not depend on which input's massive token it sees — the massive "
        "token's ME-layer output swapped for another prompt's (still massive) keeps the sink",
        kind="control",
        statistic="1 − " + _SINK + " (signed; judged by its size)",
        op="|x|<",
        control="the removal conditions",
    ),
)
SPEC = claims.index(SPECS)


@dataclass(frozen=True)
class Config(SiteConfig):
    """Sink-causality settings.

    Attributes:
        conditions: the interventions to run, each separately (``patch_other`` is the control); a
            claim whose condition is not run is not applicable.
        max_tokens: prompts are cut to their first ``max_tokens`` tokens (the sink is on the first
            token; >= 2).
        max_prompts: how many prompts to use, spread evenly over the prompt list (``None``: all).
            One forward per condition; the default keeps the bundled model's run around half a
            minute on two CPU cores.
    """

    conditions: tuple[str, ...] = checked(CONDITIONS, choices=CONDITIONS, nonempty=True)
    max_tokens: int = checked(32, ge=2)
    max_prompts: int | None = checked(48, ge=1)


@dataclass
class Measure:
    """One condition's per-prompt measurements.

    Attributes:
        attention: ``[layer, batch, head]`` mean attention of the real queries ``q > p`` to ``p``.
        entropy: ``[layer, batch]`` attention entropy (nats), mean over heads and those queries.
        me_ratio: ``[batch]`` norm ratio ``‖h_p‖ / mean_{t≠p}‖h_t‖`` at the ME-layer output.
        last_ratio: ``[batch]`` the same at the last layer.
    """

    attention: torch.Tensor
    entropy: torch.Tensor
    me_ratio: torch.Tensor
    last_ratio: torch.Tensor


def _record_pattern(pattern, hook, *, store, layer, p, qmask):
    a = pattern.detach().float()  # [batch head q k]
    qm = qmask.to(a.device, a.dtype)[:, None, :]  # [batch 1 q]
    n = qm.sum(-1)
    to_p = (a[..., p] * qm).sum(-1) / n  # [batch head]
    ent = (attention_entropy(a) * qm).sum(-1) / n  # [batch head]
    store[layer] = (to_p.cpu(), ent.mean(-1).cpu())
    return pattern


def measure(
    model: LoadedModel, batch: Batch, layer: int, p: int, fwd_hooks: Sequence = ()
) -> Measure:
    """One forward of ``batch`` under ``fwd_hooks`` (stopping before the unembedding)."""
    q = batch.attention_mask.bool().clone()
    q[:, : p + 1] = False
    if not q.any(-1).all():
        raise ValueError(f"every prompt needs a token after position {p}")
    pats: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    last = model.n_layers - 1
    hooks = [
        (names.pattern(x), partial(_record_pattern, store=pats, layer=x, p=p, qmask=q))
        for x in range(model.n_layers)
    ]
    res = Activations(model, batch, [names.resid_post(x) for x in {layer, last}])
    record(model, batch, [res], fwd_hooks=[*fwd_hooks, *hooks], last_layer=last)
    mask = batch.attention_mask.bool().cpu()
    ref = torch.full((len(batch),), p, dtype=torch.long)

    def ratio(x: int) -> torch.Tensor:
        return ratio_to_others(res[names.resid_post(x)].float().norm(dim=-1).cpu(), mask, ref)

    return Measure(
        attention=torch.stack([pats[x][0] for x in range(model.n_layers)]),
        entropy=torch.stack([pats[x][1] for x in range(model.n_layers)]),
        me_ratio=ratio(layer),
        last_ratio=ratio(last),
    )


def condition_hooks(model, batch, site: Site, cond: str, acts=None) -> list:
    """The hooks of one condition (see module docstring); ``acts``: an :class:`~me_interp.probes.activations.Activations` of the unedited run."""
    L, p = site.layer, [site.position]
    if cond == "remove_ffn":
        return causal.remove_massive(model, batch, L, p, None, site="ffn_out", acts=acts)
    if cond == "remove_dims":
        return causal.remove_massive(model, batch, L, p, site.dims, site="resid_post", acts=acts)
    if cond == "remove_all":
        return causal.remove_massive(model, batch, L, p, None, site="resid_post", acts=acts)
    if cond == "patch_other":
        return causal.patch_across_prompts(model, batch, L, p, acts=acts)
    raise ValueError(f"unknown condition {cond!r}; choose from {', '.join(CONDITIONS)}")


@dataclass
class Result:
    model: str
    bos: str
    site: Site
    prompts: causal.PromptBatch
    n_layers: int
    measures: dict[str, Measure]  # "baseline" and every condition run
    same_prefix: bool  # every prompt has the same tokens up to p (the swap control is the identity)
    ffn: FfnShare  # the ME layer's FFN output at p against p's state there
    seed: int = 0

    def sink_heads(self) -> list[tuple[int, int]]:
        """(layer, head) after the ME layer whose unmodified attention to ``p`` (mean over prompts)
        reaches the ``sink_attention`` threshold."""
        base = self.measures["baseline"].attention.mean(1)  # [layer head]
        t = claims.threshold("sink_attention")
        return [
            (layer, h)
            for layer in range(self.site.layer + 1, self.n_layers)
            for h in range(base.shape[1])
            if float(base[layer, h]) >= t
        ]

    def sink_per_prompt(self, cond: str) -> torch.Tensor:
        """``[batch]`` mean attention of the sink heads to ``p`` (NaN when there are none)."""
        heads = self.sink_heads()
        a = self.measures[cond].attention  # [layer batch head]
        if not heads:
            return torch.full((a.shape[1],), float("nan"))
        return torch.stack([a[layer, :, h] for layer, h in heads]).mean(0)

    def attention_per_layer(self, cond: str) -> list[float]:
        """Mean over prompts and heads of the attention to ``p``, per layer."""
        return self.measures[cond].attention.mean((1, 2)).tolist()

    def entropy_after_me(self, cond: str) -> torch.Tensor:
        """``[batch]`` attention entropy, mean over the layers after the ME layer."""
        return self.measures[cond].entropy[self.site.layer + 1 :].mean(0)

    def sink_rate(self, cond: str) -> list[float]:
        """Per layer, the fraction of heads whose mean attention to ``p`` reaches the threshold."""
        a = self.measures[cond].attention.mean(1)  # [layer head]
        return (a >= claims.threshold("sink_attention")).float().mean(-1).tolist()

    def removal_fraction(self, cond: str) -> float:
        """The share of the massive token's excess ME-layer norm ratio the condition leaves."""
        return claims.excess_fraction(
            float(self.measures[cond].me_ratio.mean()),
            float(self.measures["baseline"].me_ratio.mean()),
        )

    def drop(self, cond: str) -> float:
        """Point estimate ``1 − mean(after) / mean(before)`` of the sink heads' attention."""
        return float(
            1 - self.sink_per_prompt(cond).mean() / self.sink_per_prompt("baseline").mean()
        )

    def to_dict(self) -> dict[str, Any]:
        conds = list(self.measures)
        return {
            "model": self.model,
            "bos": self.bos,
            "massive_site": self.site.to_dict(),
            "prompts": self.prompts.to_dict(),
            "sink_attention_threshold": claims.threshold("sink_attention"),
            "sink_heads": [list(x) for x in self.sink_heads()],
            "same_prefix": self.same_prefix,
            "ffn_share": self.ffn.to_dict(),
            "conditions": {
                c: {
                    "sink_heads_attention": float(self.sink_per_prompt(c).mean()),
                    "sink_drop": self.drop(c) if c != "baseline" else 0.0,
                    "entropy_after_me": float(self.entropy_after_me(c).mean()),
                    "me_ratio": float(self.measures[c].me_ratio.mean()),
                    "last_ratio": float(self.measures[c].last_ratio.mean()),
                }
                for c in conds
            },
            "per_prompt": {
                c: {
                    "sink_heads_attention": self.sink_per_prompt(c).tolist(),
                    "entropy_after_me": self.entropy_after_me(c).tolist(),
                    "me_ratio": self.measures[c].me_ratio.tolist(),
                    "last_ratio": self.measures[c].last_ratio.tolist(),
                }
                for c in conds
            },
            "per_layer": {
                "attention_to_massive": {c: self.attention_per_layer(c) for c in conds},
                "entropy": {c: self.measures[c].entropy.mean(1).tolist() for c in conds},
                "sink_rate": {c: self.sink_rate(c) for c in conds},
            },
            "per_head_attention": {c: self.measures[c].attention.mean(1).tolist() for c in conds},
        }


def run(cfg: Config, model: LoadedModel | None = None) -> Result:
    """Measure the sink with and without the massive activation. No printing, no files.

    Raises:
        claims.NotApplicable: no massive activation on this model and no ``layer`` given.
    """
    model = model_for(cfg, model)
    pb = causal.prompt_batch(model, cfg.load_prompts(), cfg.max_tokens, cfg.max_prompts)
    site = locate(model, pb.batch, layer=cfg.layer, position=cfg.position, seed=cfg.seed)
    site.require("pass --layer to intervene anyway")
    p, L = site.position, site.layer
    pb = pb.at_least(p + 2)  # a query after the massive token
    batch = pb.batch
    acts = Activations(model, batch, [names.ffn_out(L), names.resid_post(L)])
    record(model, batch, [acts], last_layer=L, max_tokens=None)
    measures = {"baseline": measure(model, batch, L, p)}
    for cond in cfg.conditions:
        if cond == "patch_other" and len(batch) < 2:
            continue  # needs another prompt to swap in
        measures[cond] = measure(
            model, batch, L, p, condition_hooks(model, batch, site, cond, acts)
        )
    prefix = batch.tokens[:, : p + 1]
    return Result(
        model=model.name,
        bos=model.bos,
        site=site,
        prompts=pb,
        n_layers=model.n_layers,
        measures=measures,
        same_prefix=bool((prefix == prefix[:1]).all()),
        ffn=ffn_share(model, batch, L, p, acts=acts),
        seed=cfg.seed,
    )


@claims.of_means
def _drop_stat(m: np.ndarray) -> np.ndarray | float:
    """Columns ``[after, before]`` (means ``m``) → ``1 − mean(after) / mean(before)``."""
    return 1 - claims.divide(m[..., 0], m[..., 1])


def figures(result: Result) -> dict[str, Any]:
    p = result.site.position
    conds = list(result.measures)
    att = plotting.layer_lines(
        {c: result.attention_per_layer(c) for c in conds},
        f"Attention to position {p} (mean over heads and queries) — {result.model}",
        "attention mass",
        result.site.layer,
    )
    rate = plotting.layer_lines(
        {c: result.sink_rate(c) for c in conds},
        f"Sink rate (fraction of heads with attention to {p} >= "
        f"{claims.threshold('sink_attention'):g})",
        "sink rate",
        result.site.layer,
    )
    ent = plotting.layer_lines(
        {c: result.measures[c].entropy.mean(1).tolist() for c in conds},
        f"Attention entropy (nats) — {result.model}",
        "entropy",
        result.site.layer,
    )
    return {"attention_to_massive": att, "sink_rate": rate, "attention_entropy": ent}


def summary(result: Result) -> str:
    s = result.site
    rows = [
        (
            c,
            float(result.sink_per_prompt(c).mean()),
            "-" if c == "baseline" else result.drop(c),
            float(result.entropy_after_me(c).mean()),
            float(result.measures[c].me_ratio.mean()),
            float(result.measures[c].last_ratio.mean()),
        )
        for c in result.measures
    ]
    return "\n".join(
        [
            f"model: {result.model}   ME layer {s.layer} (1-based {s.layer + 1}), position "
            f"{s.position}, dims {list(s.dims)[:6]}; {len(result.sink_heads())} sink heads; "
            f"{len(result.prompts.indices)} prompts",
            fmt_table(
                [
                    "condition",
                    "sink heads attn->p",
                    "drop",
                    "entropy after ME",
                    "ME ratio",
                    "last ratio",
                ],
                rows,
            ),
        ]
    )


EXPERIMENT = Experiment(
    NAME, Config, run, SPECS, figures, summary, __doc__, key_figures=("attention_to_massive",)
)
main = command(EXPERIMENT)


if __name__ == "__main__":
    raise SystemExit(main())
