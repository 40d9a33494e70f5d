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
one claim (:data:`SPECS`), judged on the sink heads' attention to ``p`` after the condition over
before (ratio of prompt means, bootstrapped over prompts): a removal claim holds when the sink drops
by at least the ``relative_drop`` threshold; it is not applicable when the condition did not remove
the massive activation (the ``removed`` rule on the ME-layer norm ratio). The control holds when the
sink changes by less than that; it is not applicable when every prompt has the same tokens up to
``p`` (then the swap is the identity: the trap of paper.md §4).

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
from me_interp.experiments.common import SiteConfig, check_choices, cli_main, fmt_table, model_for
from me_interp.interventions import causal
from me_interp.models import Batch, LoadedModel
from me_interp.probes.attention import attention_entropy
from me_interp.probes.norms import ratio_to_others

NAME = "sink_causality"
CONDITIONS: tuple[str, ...] = ("remove_ffn", "remove_dims", "remove_all", "patch_other")
CONTROLS: tuple[str, ...] = ("patch_other",)
_SINK = (
    "the sink heads' mean attention to p after the condition over before (ratio of prompt means)"
)

SPECS: tuple[claims.Spec, ...] = (
    claims.Spec(
        "sink_causality.remove_ffn",
        "§2.6",
        "The massive activation causes the downstream attention sink: never writing it (the ME "
        "layer's FFN output of the massive token set to the other tokens' mean) makes the sink "
        "heads of the later layers drop their attention to that token",
        "1 − " + _SINK,
        ">=",
        "relative_drop",
        control="the unmodified run; the patch_other control",
    ),
    claims.Spec(
        "sink_causality.remove_all",
        "§2.6",
        "The sink reads the massive token's state after the ME layer: replacing its whole ME-layer "
        "output by the other tokens' mean makes the sink heads drop their attention to it",
        "1 − " + _SINK,
        ">=",
        "relative_drop",
        control="the unmodified run; the patch_other control",
    ),
    claims.Spec(
        "sink_causality.remove_dims",
        "§2.6, §4 (massive dims)",
        "The massive dims alone carry the sink: resetting only them (to the other tokens' mean) at "
        "the ME-layer output makes the sink heads drop their attention to the massive token",
        "1 − " + _SINK,
        ">=",
        "relative_drop",
        control="remove_all (the whole state)",
    ),
    claims.Spec(
        "sink_causality.patch_other",
        "§2.4 (directional invariance)",
        "Control: the sink does not depend on which input's massive token it sees — the massive "
        "token's ME-layer output swapped for another prompt's (still massive) keeps the sink",
        "1 − " + _SINK + " (signed; judged by its size)",
        "|x|<",
        "relative_drop",
        control="the removal conditions",
    ),
)
SPEC = claims.index(SPECS)


@dataclass(frozen=True)
class Config(SiteConfig):
    """Sink-causality settings.

    Attributes:
        conditions: the interventions to run, each separately (``remove_ffn``, ``remove_dims``,
            ``remove_all``, and the control ``patch_other``); a claim whose condition is not run is
            not applicable.
        max_tokens: prompts are cut to their first ``max_tokens`` tokens (the sink is on the first
            token; >= 2).
        max_prompts: how many prompts to use, spread evenly over the prompt list (``None``: all).
            One forward per condition; 48 keeps the bundled model's run around half a minute on two
            CPU cores.
    """

    conditions: tuple[str, ...] = CONDITIONS
    max_tokens: int = 32
    max_prompts: int | None = 48

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choices(self.conditions, CONDITIONS, "condition")
        if self.max_tokens < 2:
            raise ValueError("max_tokens must be >= 2")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise ValueError("max_prompts must be >= 1 (or None for all)")


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


def _record(x, hook, *, store, key):
    store[key] = x.detach()
    return x


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
    res: dict[str, torch.Tensor] = {}
    last = model.n_layers - 1
    hooks = [
        (names.pattern(x), partial(_record_pattern, store=pats, layer=x, p=p, qmask=q))
        for x in range(model.n_layers)
    ]
    hooks += [(names.resid_post(x), partial(_record, store=res, key=str(x))) for x in {layer, last}]
    model.run_with_hooks(batch, [*fwd_hooks, *hooks], stop_at_layer=model.n_layers)
    mask = batch.attention_mask.bool().cpu()
    ref = torch.full((len(batch),), p, dtype=torch.long)

    def ratio(x: int) -> torch.Tensor:
        return ratio_to_others(res[str(x)].float().norm(dim=-1).cpu(), mask, ref)

    return Measure(
        attention=torch.stack([pats[x][0] for x in range(model.n_layers)]),
        entropy=torch.stack([pats[x][1] for x in range(model.n_layers)]),
        me_ratio=ratio(layer),
        last_ratio=ratio(last),
    )


def condition_hooks(model, batch, site: causal.MassiveSite, cond: str, acts=None) -> list:
    """The hooks of one condition (see module docstring); ``acts`` from :func:`causal.capture`."""
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
    site: causal.MassiveSite
    prompts: causal.PromptBatch
    n_layers: int
    measures: dict[str, Measure]  # "baseline" and every condition run
    same_prefix: bool  # every prompt has the same tokens up to p (the swap control is the identity)
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
    site = causal.locate_massive(model, pb.batch, cfg.layer, cfg.position)
    p, L = site.position, site.layer
    pb = pb.at_least(p + 2)  # a query after the massive token
    batch = pb.batch
    acts = causal.capture(model, batch, [names.ffn_out(L), names.resid_post(L)])
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
        seed=cfg.seed,
    )


def _drop_stat(a: np.ndarray) -> float:
    """Columns ``[after, before]`` → ``1 − mean(after) / mean(before)``."""
    m = a.mean(0)
    return float(1 - m[0] / m[1]) if m[1] else float("nan")


def verdicts(result: Result) -> list[claims.Claim]:
    """One claim per condition (:data:`SPECS`)."""
    s, r = result.site, result
    why = causal.sink_not_applicable(s, r.sink_heads)
    if why is not None:
        return claims.not_applicable(SPECS, why)
    heads = r.sink_heads()
    base = r.measures["baseline"]
    before = r.sink_per_prompt("baseline").double().numpy()
    n = len(before)
    out = []
    for key, spec in SPEC.items():
        if key not in r.measures:
            out.append(spec.not_applicable(f"the condition {key} was not run (--conditions)"))
            continue
        m = r.measures[key]
        after = r.sink_per_prompt(key).double().numpy()
        frac = causal.excess_fraction(float(m.me_ratio.mean()), float(base.me_ratio.mean()))
        details = (
            f"{len(heads)} sink heads after ME layer {s.layer} (1-based {s.layer + 1}), position "
            f"{s.position}: attention {before.mean():.3g} -> {after.mean():.3g}; entropy after "
            f"the ME layer {float(r.entropy_after_me('baseline').mean()):.3g} -> "
            f"{float(r.entropy_after_me(key).mean()):.3g} nats; ME-layer norm ratio "
            f"{float(base.me_ratio.mean()):.4g} -> {float(m.me_ratio.mean()):.4g}; n = {n} prompts"
        )
        rows = np.stack([after, before], 1)
        if key in CONTROLS:
            if r.same_prefix:
                out.append(
                    spec.not_applicable(
                        f"every prompt has the same tokens up to position {s.position}, so the "
                        "swapped-in state is the prompt's own (use prompts with different first "
                        "tokens)"
                    )
                )
                continue
            est = claims.bootstrap(rows, _drop_stat, seed=r.seed)
        else:
            if not frac <= claims.threshold("removed"):
                out.append(
                    spec.not_applicable(
                        f"the condition did not remove the massive activation: ME-layer (R − 1) "
                        f"after / before = {frac:.3g} > {claims.threshold('removed'):g} "
                        "(threshold 'removed')"
                    )
                )
                continue
            est = claims.bootstrap(rows, _drop_stat, seed=r.seed)
        out.append(spec.judge(est, details=details))
    return out


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


def main(argv: Sequence[str] | None = None) -> int:
    return cli_main(NAME, Config, run, figures, summary, argv, description=__doc__)


if __name__ == "__main__":
    raise SystemExit(main())
