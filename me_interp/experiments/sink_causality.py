"""Sink causality: remove the massive activation at the ME layer and measure the attention sink downstream.

The paper (paper.md §2, claim 6) says the massive activation *causes* the attention sink on its token.
This experiment edits the massive token ``p`` at the ME layer (both measured by the ME-layer probe)
and compares, at every layer and head, the attention of the real queries ``q > p`` to ``p`` and the
attention entropy with the unmodified run (:mod:`me_interp.probes.to_position`, one forward per
condition):

``remove_ffn``, ``remove_dims``, ``remove_all`` and the control ``patch_other``
(:mod:`me_interp.interventions.conditions`).

*Sink heads* are the heads after the ME layer whose unmodified mean attention to ``p`` reaches the
``sink_attention`` threshold. A removal is judged only where it *is* a removal: the edited token
must be ordinary afterwards (:mod:`me_interp.probes.removal`, threshold ``ordinary_ratio``, at the
ME layer and the last layer), or its claim is not applicable.

    python -m me_interp.experiments.sink_causality
    python -m me_interp.experiments.sink_causality --model synthetic:planted --prompts p.txt
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from me_interp import claims, evaluation, names, plotting
from me_interp.interventions.causal import PromptsUsed
from me_interp.interventions.conditions import REMOVALS, Conditions, condition_hooks
from me_interp.loading.loaded import LoadedModel
from me_interp.probes.activations import Activations
from me_interp.probes.batching import record
from me_interp.probes.ffn import HasFfnShare, ffn_share
from me_interp.probes.site import Site
from me_interp.probes.to_position import (
    ToPosition,
    heads_mean,
    read_position,
    sink_claims_why,
    sink_heads,
)
from me_interp.study.cli import command
from me_interp.study.config import SiteConfig, checked
from me_interp.study.experiment import Experiment, prepare, prompt_inputs
from me_interp.study.result import Headed, RunHeader, run_header
from me_interp.terminal import fmt_table

NAME = "sink_causality"
CONDITIONS = REMOVALS
CONTROLS: tuple[str, ...] = ("patch_other",)
_SINK = (
    "the sink heads' mean attention to p after the condition over before (ratio of prompt means)"
)


@dataclass(frozen=True)
class Condition:
    """One condition's measurements (``baseline``: the unmodified run).

    Attributes:
        sink: per prompt, the sink heads' mean attention to ``p`` (NaN without sink heads).
        head_attention: ``[layer][head]`` attention to ``p``, mean over prompts and queries.
        entropy: per layer, the attention entropy (nats), mean over prompts.
        entropy_after_me: per prompt, the entropy averaged over the layers after the ME layer.
        me_ratio, last_ratio: per prompt, ``p``'s norm ratio at the ME-layer and last-layer output.
    """

    name: str
    sink: list[float]
    head_attention: list[list[float]]
    entropy: list[float]
    entropy_after_me: list[float]
    me_ratio: list[float]
    last_ratio: list[float]

    def layer_attention(self) -> list[float]:
        """Per layer, the attention to ``p`` (mean over prompts and heads)."""
        return [float(np.mean(h)) for h in self.head_attention]

    def sink_rate(self) -> list[float]:
        """Per layer, the fraction of heads whose mean attention to ``p`` reaches the threshold."""
        t = claims.threshold("sink_attention")
        return [float(np.mean(np.asarray(h) >= t)) for h in self.head_attention]


@dataclass(frozen=True)
class Result(Headed, Conditions, HasFfnShare):
    """The conditions and what they did (``header``: the ME layer, position ``p`` and dims).

    Attributes:
        why_not: why the claims about a massive activation at the layer do not apply (``None``).
        sink_heads: ``(layer, head)`` after the ME layer whose unmodified attention to ``p`` (mean
            over prompts) reaches the ``sink_attention`` threshold.
        conditions: ``baseline`` first, then every condition run.
        same_prefix: every prompt has the same tokens up to ``p`` (the swap control is the identity).
        ffn_cos, ffn_norm_ratio: per prompt, the ME layer's FFN output at ``p`` against ``p``'s state
            there (:class:`~me_interp.probes.ffn.FfnShare`).
    """

    header: RunHeader
    prompts: PromptsUsed
    why_not: str | None
    n_layers: int
    sink_heads: list[tuple[int, int]]
    conditions: list[Condition]
    same_prefix: bool
    ffn_cos: tuple[float, ...]
    ffn_norm_ratio: tuple[float, ...]

    def sink_per_prompt(self, name: str) -> np.ndarray:
        return np.asarray(self.of(name).sink, dtype=np.float64)

    def drop(self, name: str) -> float:
        """Point estimate ``1 − mean(after) / mean(before)`` of the sink heads' attention."""
        return float(
            1 - self.sink_per_prompt(name).mean() / self.sink_per_prompt("baseline").mean()
        )


def _why(key: str):
    """Why the spec of condition ``key`` does not apply (``None`` when it does)."""

    def why(r: Result) -> str | None:
        h = r.header
        why = sink_claims_why(r.why_not, h.layer, r.n_layers, h.position, r.sink_heads)
        if why := why or r.not_run(key):
            return why
        if key in CONTROLS:
            if r.same_prefix:
                return (
                    f"every prompt has the same tokens up to position {h.position}, so the "
                    "swapped-in state is the prompt's own (use prompts with different first tokens)"
                )
            return None
        if key == "remove_ffn":  # see _removed_by_ffn
            gate = _removed_by_ffn(r)
        else:
            gate = r.not_removed(key, key)
        if gate is not None:
            return gate
        if key == "remove_ffn" and r.ffn.is_state():
            return (
                f"{r.ffn.text()}: the FFN output is the state itself, so removing it is removing "
                "the whole state — the sanity check remove_all"
            )
        return None

    return why


def _removed_by_ffn(r: Result) -> str | None:
    """``remove_ffn``'s gate, ``(R − 1)`` at the ME layer at most the ``removed`` fraction of the
    excess, not the ordinary-token rule: it is judged only where the FFN output is not the state,
    i.e. where ≥ 5 % of the massive state predates the FFN and stays (32× on ``decoy-primed``), so
    that rule would never let it be decided; it is about the FFN's write."""
    frac = r.excess("remove_ffn", last=False)
    if frac <= claims.threshold("removed"):
        return None
    return (
        f"the condition did not remove the massive activation: ME-layer (R − 1) after / before = "
        f"{frac:.3g} > {claims.threshold('removed'):g} (threshold 'removed')"
    )


def _stat(key: str):
    def stat(r: Result) -> claims.Sample:
        rows = np.stack([r.sink_per_prompt("baseline"), r.sink_per_prompt(key)], 1)
        return claims.Sample(rows, evaluation.sink_drop)  # the attention is never negative

    return stat


def _details(key: str):
    def details(r: Result) -> str:
        h, base, m = r.header, r.of("baseline"), r.of(key)
        out = (
            f"{len(r.sink_heads)} sink heads after ME layer {h.layer} (1-based {h.layer + 1}), "
            f"position {h.position}: attention {np.mean(base.sink):.3g} -> {np.mean(m.sink):.3g}; "
            f"entropy after the ME layer {np.mean(base.entropy_after_me):.3g} -> "
            f"{np.mean(m.entropy_after_me):.3g} nats; norm ratio R of p at the ME layer "
            f"{np.mean(base.me_ratio):.4g} -> {np.mean(m.me_ratio):.4g}, at the last layer "
            f"{np.mean(base.last_ratio):.4g} -> {np.mean(m.last_ratio):.4g}; n = {len(base.sink)} "
            "prompts"
        )
        others = [c.name for c in r.conditions if c.name not in ("baseline", key)]
        if others:
            out += "; drops of the other conditions: " + ", ".join(
                f"{c} {r.drop(c):.3g}" for c in others
            )
        if key in ("remove_ffn", "remove_all"):
            out += f"; {r.ffn.text()}"
        return out

    return details


def _spec(key: str, section: str, statement: str, kind: str = "claim", **kw) -> claims.Spec:
    statistic, op = kw.pop("statistic", "1 − " + _SINK), kw.pop("op", ">=")
    return claims.Spec(
        f"sink_causality.{key}",
        section,
        statement,
        statistic,
        op,
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
        "tokens' mean), which leaves it an ordinary token, makes the later sink heads drop their "
        "attention to it: the massive dims carry the sink",
        control="remove_all (the whole state, in the details); transplant.state_follows",
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


def _condition(name: str, m: ToPosition, heads: list[tuple[int, int]], layer: int) -> Condition:
    return Condition(
        name,
        heads_mean(m.attention, heads),
        m.attention.mean(1).tolist(),
        m.entropy.mean(1).tolist(),
        m.entropy[layer + 1 :].mean(0).tolist(),
        m.ratio.tolist(),
        m.last_ratio.tolist(),
    )


def run(cfg: Config, model: LoadedModel | None = None, site: Site | None = None) -> Result:
    """Measure the sink with and without the massive activation. No printing, no files.

    Raises:
        claims.NotApplicable: no massive activation on this model and no ``layer`` given.
    """
    model, site = prepare(EXPERIMENT, cfg, model, site)
    pb = site.inputs
    site.require("pass --layer to intervene anyway")
    p, L = site.position, site.layer
    pb = pb.at_least(p + 2)  # a query after the massive token
    batch = pb.batch
    acts = Activations(model, batch, [names.ffn_out(L), names.resid_post(L)])
    record(model, batch, [acts], last_layer=L, max_tokens=None)
    base = read_position(model, batch, L, p)
    heads = sink_heads(base.attention.mean(1), L + 1)  # [layer head]: mean over prompts
    conds = [_condition("baseline", base, heads, L)]
    for cond in cfg.conditions:
        if cond == "patch_other" and len(batch) < 2:
            continue  # needs another prompt to swap in
        hooks = condition_hooks(model, batch, cond, L, p, site.dims, acts=acts)
        m = read_position(model, batch, L, p, hooks)
        conds.append(_condition(cond, m, heads, L))
    share = ffn_share(model, batch, L, p, acts=acts)
    header = run_header(cfg, model, len(batch), site)
    return Result(
        header,
        pb.used(),
        site.why_not,
        model.n_layers,
        heads,
        conds,
        pb.same_prefix(p),
        share.cos,
        share.norm_ratio,
    )


def figures(result: Result) -> dict[str, object]:
    h, cs = result.header, result.conditions
    t = claims.threshold("sink_attention")
    series = (
        (
            "attention_to_massive",
            Condition.layer_attention,
            "attention mass",
            f"Attention to position {h.position} (mean over heads and queries) — {h.model}",
        ),
        (
            "sink_rate",
            Condition.sink_rate,
            "sink rate",
            f"Sink rate (fraction of heads with attention to {h.position} >= {t:g})",
        ),
        (
            "attention_entropy",
            lambda c: c.entropy,
            "entropy",
            f"Attention entropy (nats) — {h.model}",
        ),
    )
    return {
        stem: plotting.layer_lines({c.name: f(c) for c in cs}, title, y, h.layer)
        for stem, f, y, title in series
    }


def summary(result: Result) -> str:
    h = result.header
    rows = [
        (
            c.name,
            float(np.mean(c.sink)),
            "-" if c.name == "baseline" else result.drop(c.name),
            float(np.mean(c.entropy_after_me)),
            float(np.mean(c.me_ratio)),
            float(np.mean(c.last_ratio)),
        )
        for c in result.conditions
    ]
    head = ["condition", "sink heads attn->p", "drop", "entropy after ME", "ME ratio", "last ratio"]
    return "\n".join(
        [
            f"model: {h.model}   ME layer {h.layer} (1-based {h.layer_1based}), position "
            f"{h.position}, dims {list(h.dims)[:6]}; {len(result.sink_heads)} sink heads; "
            f"{h.n_prompts} prompts",
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
    key_figures=("attention_to_massive",),
    inputs=prompt_inputs,
)
main = command(EXPERIMENT)


if __name__ == "__main__":
    raise SystemExit(main())
