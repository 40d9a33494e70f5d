"""Sink causality: remove the massive activation at the ME layer and measure the attention sink downstream.

The paper (paper.md §2, claim 6) says the massive activation *causes* the attention sink on its token.
This experiment removes it at the ME layer (measured with the ME-layer probe) and compares, at every
layer, the attention mass on the massive position ``p`` and the attention entropy with the unmodified
run (``probes.attention_stats``: mean over heads and real queries ``q ≥ 1``):

* ``remove_ffn``  — the ME layer's FFN output of token ``p`` set to the other tokens' mean FFN output
  (the massive activation is never written);
* ``remove_dims`` — token ``p``'s massive dims of the ME-layer output set to the other tokens' mean;
* ``remove_all``  — token ``p``'s whole ME-layer output set to the other tokens' mean;
* ``patch_other`` — control: token ``p``'s ME-layer output replaced by that of the next prompt
  (still massive, from another input): the sink should survive.

*Sink heads* are the heads of the layers after the ME layer whose unmodified mean attention to ``p``
is at least ``--sink-threshold`` (0.3, the usual sink-rate threshold); the *sink rate* of a layer is the
fraction of its heads above it. The verdict uses ``--primary`` (default ``remove_ffn``): the sink *is*
caused by the massive activation when the sink heads' mean attention to ``p`` falls by at least
``--kill-fraction`` (default 0.5) of its unmodified value.

    python -m me_interp.experiments.sink_causality
    python -m me_interp.experiments.sink_causality --model synthetic:planted --prompts p.txt
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from me_interp import plotting
from me_interp.experiments.common import SiteConfig, check_choices, cli_main, fmt_table, model_for
from me_interp.interventions import causal
from me_interp.models import LoadedModel
from me_interp.patching import NormRatio, evaluate_metrics
from me_interp.probes.attention import attention_stats

NAME = "sink_causality"
CONDITIONS: tuple[str, ...] = ("remove_ffn", "remove_dims", "remove_all", "patch_other")
CONTROLS: tuple[str, ...] = ("patch_other",)
CLAIM = (
    "The massive activation causes the downstream attention sink: removing it at the ME layer "
    "kills the sink on its token in the later layers"
)


@dataclass(frozen=True)
class Config(SiteConfig):
    """Sink-causality settings.

    Attributes:
        conditions: the interventions to run, each separately (``remove_ffn``, ``remove_dims``,
            ``remove_all``, and the control ``patch_other``).
        primary: the removal condition the headline verdict uses (one of ``conditions``, not the
            control).
        kill_fraction: the sink counts as killed when the sink heads' attention to ``p`` falls by at
            least this fraction of its unmodified value, in (0, 1].
        sink_threshold: a head after the ME layer is a sink head when its unmodified attention to
            ``p`` is at least this, in (0, 1); also the threshold of the sink rate.
    """

    conditions: tuple[str, ...] = CONDITIONS
    primary: str = "remove_ffn"
    kill_fraction: float = 0.5
    sink_threshold: float = 0.3

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choices(self.conditions, CONDITIONS, "condition")
        if self.primary not in self.conditions:
            raise ValueError(
                f"primary {self.primary!r} must be one of the conditions {self.conditions}"
            )
        if self.primary in CONTROLS:
            raise ValueError(
                f"primary must be a removal condition, not the control {self.primary!r}"
            )
        if not 0 < self.kill_fraction <= 1:
            raise ValueError("kill_fraction must be in (0, 1]")
        if not 0 < self.sink_threshold < 1:
            raise ValueError("sink_threshold must be in (0, 1)")


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if len(xs) else float("nan")


@dataclass
class Result:
    model: str
    bos: str
    site: causal.MassiveSite
    n_layers: int
    primary: str
    kill_fraction: float
    sink_threshold: float
    head_attention: dict[str, list[list[float]]]  # condition (incl. "baseline") -> [layer][head]
    entropy: dict[str, list[float]]
    last_ratio: dict[str, float]

    @property
    def attention(self) -> dict[str, list[float]]:
        """Per condition and layer: attention to ``p``, mean over heads."""
        return {c: [sum(h) / len(h) for h in v] for c, v in self.head_attention.items()}

    def sink_rate(self, cond: str) -> list[float]:
        t = self.sink_threshold
        return [sum(a >= t for a in h) / len(h) for h in self.head_attention[cond]]

    def sink_heads(self) -> list[tuple[int, int]]:
        """(layer, head) after the ME layer with unmodified attention to ``p`` >= the threshold."""
        base = self.head_attention["baseline"]
        return [
            (layer, h)
            for layer in range(self.site.layer + 1, self.n_layers)
            for h, a in enumerate(base[layer])
            if a >= self.sink_threshold
        ]

    def downstream(self, cond: str) -> float:
        """Mean attention to ``p`` of the sink heads (NaN when there are none)."""
        heads = self.sink_heads()
        xs = [self.head_attention[cond][layer][h] for layer, h in heads]
        return sum(xs) / len(xs) if xs else float("nan")

    def downstream_entropy(self, cond: str) -> float:
        return _mean(self.entropy[cond][self.site.layer + 1 :])

    def holds(self, cond: str) -> bool | None:
        base = self.downstream("baseline")
        if not self.sink_heads() or not base > 0:
            return None
        return bool(self.downstream(cond) <= (1 - self.kill_fraction) * base)

    def to_dict(self) -> dict[str, Any]:
        p = self.primary
        base, after = self.downstream("baseline"), self.downstream(p)
        return {
            "claim": CLAIM,
            "baseline": {
                "sink_heads_attention": base,
                "entropy_after_me": self.downstream_entropy("baseline"),
                "last_layer_norm_ratio": self.last_ratio["baseline"],
            },
            "intervened": {
                "condition": p,
                "sink_heads_attention": after,
                "entropy_after_me": self.downstream_entropy(p),
                "last_layer_norm_ratio": self.last_ratio[p],
            },
            "verdict": {
                "holds": self.holds(p),
                "attention_ratio": after / base if base else float("nan"),
                "rule": f"attention after / before <= {1 - self.kill_fraction:g}",
            },
            "model": self.model,
            "bos": self.bos,
            "massive_site": self.site.to_dict(),
            "sink_threshold": self.sink_threshold,
            "sink_heads": [list(x) for x in self.sink_heads()],
            "conditions": {
                c: {
                    "sink_heads_attention": self.downstream(c),
                    "sink_rate_after_me": _mean(self.sink_rate(c)[self.site.layer + 1 :]),
                    "entropy_after_me": self.downstream_entropy(c),
                    "last_layer_norm_ratio": self.last_ratio[c],
                    "holds": self.holds(c) if c != "baseline" else None,
                }
                for c in self.head_attention
            },
            "per_layer": {
                "attention_to_massive": self.attention,
                "entropy": self.entropy,
                "sink_rate": {c: self.sink_rate(c) for c in self.head_attention},
            },
            "per_head_attention": self.head_attention,
        }


def condition_hooks(model, batch, site: causal.MassiveSite, cond: str) -> list:
    """The hooks of one removal condition (see module docstring)."""
    L, p = site.layer, [site.position]
    if cond == "remove_ffn":
        return causal.remove_massive(model, batch, L, p, None, site="ffn_out")
    if cond == "remove_dims":
        return causal.remove_massive(model, batch, L, p, site.dims, site="resid_post")
    if cond == "remove_all":
        return causal.remove_massive(model, batch, L, p, None, site="resid_post")
    if cond == "patch_other":
        return causal.patch_across_prompts(model, batch, L, p)
    raise ValueError(f"unknown condition {cond!r}; choose from {', '.join(CONDITIONS)}")


def run(cfg: Config, model: LoadedModel | None = None) -> Result:
    """Measure the sink with and without the massive activation. No printing, no files."""
    model = model_for(cfg, model)
    batch = model.tokenize(cfg.load_prompts())
    site = causal.locate_massive(model, batch, cfg.layer, cfg.position)
    last = {"r": NormRatio(model.n_layers - 1, site.position)}
    heads, entropy, ratio = {}, {}, {}
    for cond in ("baseline", *cfg.conditions):
        hooks = [] if cond == "baseline" else condition_hooks(model, batch, site, cond)
        st = attention_stats(model, batch, [site.position], fwd_hooks=hooks)
        heads[cond] = st.to_positions.mean(1).tolist()  # [layer head]
        entropy[cond] = st.mean_entropy()
        ratio[cond] = float(evaluate_metrics(model, batch, last, hooks)["r"].mean())
    return Result(
        model=model.name,
        bos=model.bos,
        site=site,
        n_layers=model.n_layers,
        primary=cfg.primary,
        kill_fraction=cfg.kill_fraction,
        sink_threshold=cfg.sink_threshold,
        head_attention=heads,
        entropy=entropy,
        last_ratio=ratio,
    )


def verdicts(result: Result) -> list[dict]:
    """One verdict per removal condition."""
    base = result.downstream("baseline")
    out = []
    for c in result.head_attention:
        if c == "baseline":
            continue
        after = result.downstream(c)
        if c in CONTROLS:
            killed = result.holds(c)
            out.append(
                {
                    "claim": "Control: replacing the massive token's ME-layer output by another "
                    "prompt's (still massive) keeps the sink",
                    "measured": f"sink heads' attention {base:.3f} -> {after:.3f}",
                    "holds": None if killed is None else not killed,
                }
            )
            continue
        out.append(
            {
                "claim": f"{CLAIM} ({c})",
                "measured": (
                    f"attention of the {len(result.sink_heads())} sink heads after layer "
                    f"{result.site.layer} to position {result.site.position}: "
                    f"{base:.3f} -> {after:.3f} (x{after / base:.2f}); "
                    f"entropy {result.downstream_entropy('baseline'):.3f} -> "
                    f"{result.downstream_entropy(c):.3f}"
                    if result.sink_heads()
                    else "no sink head after the ME layer in the unmodified run"
                ),
                "holds": result.holds(c),
            }
        )
    return out


def figures(result: Result) -> dict[str, Any]:
    p = result.site.position
    att = plotting.layer_lines(
        result.attention,
        f"Attention to position {p} (mean over heads and queries) — {result.model}",
        "attention mass",
        result.site.layer,
    )
    rate = plotting.layer_lines(
        {c: result.sink_rate(c) for c in result.head_attention},
        f"Sink rate (fraction of heads with attention to {p} >= {result.sink_threshold:g})",
        "sink rate",
        result.site.layer,
    )
    ent = plotting.layer_lines(
        result.entropy,
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
            result.downstream(c),
            result.downstream_entropy(c),
            result.last_ratio[c],
            "-" if c == "baseline" else str(result.holds(c)),
        )
        for c in result.head_attention
    ]
    return "\n".join(
        [
            f"model: {result.model}   ME layer {s.layer} (1-based {s.layer + 1}), position {s.position}, "
            f"dims {list(s.dims)[:6]}",
            fmt_table(
                [
                    "condition",
                    "sink heads attn->p",
                    "entropy after ME",
                    "last ratio",
                    "sink killed",
                ],
                rows,
            ),
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    return cli_main(NAME, Config, run, figures, summary, argv, description=__doc__)


if __name__ == "__main__":
    raise SystemExit(main())
