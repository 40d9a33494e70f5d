"""The mask-rate study in miniature: WeMask and its alternatives against rate r and strength α.

For every mask rate ``r ∈ rates`` and dim selection (``weight`` = the paper's text, ``activation`` = the
released code, ``random`` and ``magnitude`` = the paper's ablations), and for the soft alternatives
(``h − α P_S h`` on the ``weight`` dims at ``soft_rate``; ``h − α (⟨h,v⟩/‖v‖²) v`` with ``v`` the
massive direction estimated on the prompts) over ``α ∈ alphas``, it masks the massive token's attention
input (position 0) in layers from the measured ME layer (``start="ge"``: ≥ ME, ``"gt"``: > ME) to the
last, and measures on a shipped text sample, in one forward per condition:

* perplexity, next-token ``KL(p_ref ‖ p_int)`` and top-1 agreement with the unmodified model;
* attention to the sink (position 0) and attention entropy: per prompt and head the mean over real
  queries ``q ≥ 1``, then the mean over prompts, heads and masked layers (as ``probes.attention_stats``);
* effective rank ``exp(−Σ p_i log p_i)``, ``p = σ / Σσ`` (singular values of the token states
  ``t ≥ 1`` of each text at ``rank_layer``), mean over texts;
* optionally (``--mc true``) log-likelihood accuracy on the shipped multiple-choice items.

``r = 0`` and ``α = 0`` are the identity (tested bit-identical), so those rows are the baseline.

    python -m me_interp.experiments.wemask                     # bundled model, ~1-2 min on a CPU
    python -m me_interp.experiments.wemask --model synthetic:planted --rates 0 0.5 1
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from importlib import resources
from typing import Any

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots
from tqdm.auto import tqdm

from me_interp import evaluation, names
from me_interp.experiments.common import (
    INDEX_CONVENTION,
    CommonConfig,
    cli_main,
    fmt_table,
    model_for,
)
from me_interp.interventions import core
from me_interp.interventions.soft import DirectionProjection, dim_projection, estimate_direction
from me_interp.interventions.wemask import (
    STARTS,
    VARIANTS,
    WeMask,
    find_me_layer,
    mask_layers,
    massive_positions,
)
from me_interp.models import Batch, LoadedModel
from me_interp.probes.geometry import effective_rank
from me_interp.prompts import read_prompts

NAME = "wemask"
TEXTS_FILE = "wemask_texts.txt"
METRICS = ("perplexity", "kl", "top1", "sink", "entropy", "eff_rank")
METRIC_TITLES = {
    "perplexity": "perplexity (shipped texts)",
    "kl": "next-token KL to the unmodified model (nats)",
    "top1": "top-1 agreement with the unmodified model",
    "sink": "attention to position 0 (masked layers)",
    "entropy": "attention entropy (nats, masked layers)",
    "eff_rank": "effective rank of token states",
    "mc_accuracy": "MC accuracy (shipped items)",
}


@dataclass(frozen=True)
class Config(CommonConfig):
    """Mask-rate study settings.

    Attributes:
        rates: mask rates r ∈ [0, 1].
        variants: dim selections (``weight``, ``activation``, ``random``, ``magnitude``).
        alphas: strengths α ∈ [0, 1] of the soft alternatives (empty: skip them).
        soft_rate: rate of the ``weight`` dim set of the soft dim projection.
        start: ``ge`` (layers ≥ ME, the paper) or ``gt`` (layers > ME).
        me_layer: the ME layer (0-based); measured on the prompts when ``None``.
        texts: text file (one text per line) for the metrics; ``None``: the shipped sample.
        rank_layer: layer whose token states give the effective rank (negative: from the end).
        mc: also score the shipped multiple-choice items (one more forward per condition).
        positions: ``first`` (absolute position 0) or ``massive`` (the massive positions detected in
            each text at the ME layer; texts with none fall back to position 0).
    """

    rates: tuple[float, ...] = (0.0, 0.1, 0.3, 0.5, 0.7, 1.0)
    variants: tuple[str, ...] = VARIANTS
    alphas: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0)
    soft_rate: float = 0.1
    start: str = "ge"
    me_layer: int | None = None
    texts: str | None = None
    rank_layer: int = -1
    mc: bool = False
    positions: str = "first"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.rates:
            raise ValueError("give at least one rate")
        for r in self.rates:
            core.check_fraction(r, "rate")
        for a in self.alphas:
            core.check_fraction(a, "alpha")
        core.check_fraction(self.soft_rate, "soft_rate")
        for v in self.variants:
            if v not in VARIANTS:
                raise ValueError(f"unknown variant {v!r}; choose from {VARIANTS}")
        if self.start not in STARTS:
            raise ValueError(f"start must be one of {STARTS}, got {self.start!r}")
        if self.positions not in ("first", "massive"):
            raise ValueError(f"positions must be 'first' or 'massive', got {self.positions!r}")

    def load_texts(self) -> list[str]:
        if self.texts is None:
            text = resources.files("me_interp.data").joinpath(TEXTS_FILE).read_text("utf-8")
            return [t for t in text.splitlines() if t.strip()]
        return read_prompts(self.texts)


# ------------------------------------------------------------------------------------------
# one forward per condition
# ------------------------------------------------------------------------------------------


def _record_pattern(a: torch.Tensor, hook: Any, *, store: dict, layer: int) -> torch.Tensor:
    store[layer] = a.detach().float().cpu()
    return a


def _record_resid(x: torch.Tensor, hook: Any, *, store: dict) -> torch.Tensor:
    store["resid"] = x.detach().float().cpu()
    return x


def _measure(
    model: LoadedModel,
    batch: Batch,
    hooks: Sequence,
    layers: Sequence[int],
    rank_layer: int,
    ref_logits: torch.Tensor | None,
) -> tuple[dict[str, float], torch.Tensor]:
    store: dict[Any, torch.Tensor] = {}
    rec = [(names.pattern(L), partial(_record_pattern, store=store, layer=L)) for L in layers]
    rec.append((names.resid_post(rank_layer), partial(_record_resid, store=store)))
    logits = model.run_with_hooks(batch, [*hooks, *rec]).float().cpu()
    mask = batch.attention_mask.cpu()
    # perplexity from the same logits (as evaluation.token_nll)
    logp = torch.log_softmax(logits[:, :-1], -1)
    nll = -logp.gather(-1, batch.tokens.cpu()[:, 1:, None])[..., 0]
    valid = mask[:, 1:].bool() & mask[:, :-1].bool()
    out = {"perplexity": math.exp(float(nll[valid].mean()))}
    if ref_logits is not None:
        ag = evaluation.agreement(ref_logits, logits, mask)
        out["kl"], out["top1"] = ag.kl, ag.top1
    else:
        out["kl"], out["top1"] = 0.0, 1.0
    q = mask.bool().clone()
    q[:, 0] = False  # queries t >= 1
    qm = q[:, None, :].float()  # [batch 1 q]
    sink, ent = [], []
    for L in layers:
        a = store[L]  # [batch head q k]
        to0 = a[..., 0]
        h = -(a * a.clamp_min(1e-30).log()).sum(-1)
        n_q = qm.sum(
            -1
        )  # [batch 1]: per prompt, mean over its real queries, then over prompts/heads
        sink.append(float(((to0 * qm).sum(-1) / n_q).mean()))
        ent.append(float(((h * qm).sum(-1) / n_q).mean()))
    out["sink"] = sum(sink) / len(sink)
    out["entropy"] = sum(ent) / len(ent)
    resid = store["resid"]
    ranks = [effective_rank(resid[b, 1:n]) for b, n in enumerate(batch.lengths) if n > 2]
    out["eff_rank"] = sum(ranks) / len(ranks) if ranks else float("nan")
    return out, logits


@dataclass
class Result:
    model: str
    bos: str
    me_layer: int
    start: str
    layers: list[int]
    rank_layer: int
    n_texts: int
    n_tokens: int
    baseline: dict[str, float]
    rows: list[dict[str, Any]] = field(default_factory=list)
    positions: Any = (0,)

    def row(self, kind: str, variant: str, rate: float, alpha: float = 1.0) -> dict | None:
        for r in self.rows:
            if (
                (r["kind"], r["variant"]) == (kind, variant)
                and math.isclose(r["rate"], rate)
                and math.isclose(r["alpha"], alpha)
            ):
                return r
        return None

    def main_comparison(self) -> dict[str, Any]:
        """The headline: weight-guided WeMask at the smallest non-zero rate."""
        rates = sorted({r["rate"] for r in self.rows if r["kind"] == "wemask" and r["rate"] > 0})
        r0 = rates[0] if rates else None
        row = self.row("wemask", "weight", r0) if r0 is not None else None
        return {"rate": r0, "row": row}

    def verdict_list(self) -> list[dict[str, Any]]:
        base = self.baseline["perplexity"]
        out = []
        head = self.main_comparison()
        r0, w = head["rate"], head["row"]
        if w is not None:
            ratio = w["perplexity"] / base
            out.append(
                {
                    "claim": f"Weight-guided WeMask at a small rate (r={r0}) leaves the language model "
                    "nearly unchanged (training-free)",
                    "measured": f"perplexity {base:.3g} -> {w['perplexity']:.3g} (x{ratio:.3f}); "
                    f"KL {w['kl']:.3g} nats; top-1 agreement {w['top1']:.3f}",
                    "holds": bool(ratio < 1.05),
                    "value": ratio,
                }
            )
            for other in ("magnitude", "random", "activation"):
                o = self.row("wemask", other, r0)
                if o is None:
                    continue
                if other == "activation":
                    claim = (
                        f"The released code's activation-selected dims behave like the paper's "
                        f"weight-selected dims at r={r0}"
                    )
                    holds = bool(abs(o["perplexity"] / w["perplexity"] - 1) < 0.05)
                else:
                    claim = (
                        f"{other.capitalize()}-selected dims at the same rate (r={r0}) hurt more than "
                        "weight-selected dims (the paper's ablation)"
                    )
                    holds = bool(o["perplexity"] > 1.01 * w["perplexity"])
                out.append(
                    {
                        "claim": claim,
                        "measured": f"perplexity {other} {o['perplexity']:.3g} vs weight "
                        f"{w['perplexity']:.3g}; KL {o['kl']:.3g} vs {w['kl']:.3g}",
                        "holds": holds,
                        "value": o["perplexity"] / w["perplexity"],
                    }
                )
        full = self.row("wemask", "weight", 1.0)
        if full is not None:
            ratio = full["perplexity"] / base
            out.append(
                {
                    "claim": "Masking the whole attention input of the massive token (r=1.0) "
                    "collapses the model",
                    "measured": f"perplexity {base:.3g} -> {full['perplexity']:.3g} (x{ratio:.3g}); "
                    f"top-1 agreement {full['top1']:.3f}",
                    "holds": bool(ratio > 2.0) if ratio > 2.0 or ratio < 1.2 else None,
                    "value": ratio,
                }
            )
            out.append(
                {
                    "claim": "Masking the massive token's attention input removes the attention sink",
                    "measured": f"attention to position 0 in layers {self.layers[0]}..{self.layers[-1]}: "
                    f"{self.baseline['sink']:.3f} -> {full['sink']:.3f} at r=1.0",
                    "holds": bool(full["sink"] < 0.5 * self.baseline["sink"]),
                    "value": full["sink"] / self.baseline["sink"]
                    if self.baseline["sink"]
                    else None,
                }
            )
        return out

    def to_dict(self) -> dict[str, Any]:
        head = self.main_comparison()
        verdicts = self.verdict_list()
        first = verdicts[0] if verdicts else {"holds": None, "value": None, "claim": ""}
        return {
            "claim": first["claim"],
            "baseline": self.baseline,
            "intervened": head["row"],
            "verdict": {
                "holds": first["holds"],
                "perplexity_ratio": first["value"],
                "threshold": "perplexity ratio < 1.05",
            },
            "verdicts": verdicts,
            "model": self.model,
            "bos": self.bos,
            "me_layer": self.me_layer,
            "me_layer_1based": self.me_layer + 1,
            "start": self.start,
            "masked_layers": self.layers,
            "masked_positions": self.positions,
            "rank_layer": self.rank_layer,
            "n_texts": self.n_texts,
            "n_tokens": self.n_tokens,
            "index_convention": INDEX_CONVENTION,
            "table": self.rows,
        }


def _conditions(cfg: Config) -> list[tuple[str, str, float, float]]:
    conds = [("wemask", v, r, 1.0) for v in cfg.variants for r in cfg.rates if r > 0]
    conds += [("dim_projection", "weight", cfg.soft_rate, a) for a in cfg.alphas if a > 0]
    conds += [("direction_projection", "mean_direction", 0.0, a) for a in cfg.alphas if a > 0]
    return conds


def run(cfg: Config, model: LoadedModel | None = None) -> Result:
    """Run the sweep. No printing (a tqdm bar on stderr), no files."""
    model = model_for(cfg, model)
    prompts = model.tokenize(cfg.load_prompts())
    me = cfg.me_layer if cfg.me_layer is not None else find_me_layer(model, prompts)
    layers = list(mask_layers(model, cfg.start, me))
    rank_layer = cfg.rank_layer % model.n_layers
    batch = model.tokenize(cfg.load_texts())
    directions = estimate_direction(model, prompts, layers, "attn_in") if cfg.alphas else {}
    positions: Any = (0,)
    if cfg.positions == "massive":
        positions = [p or [0] for p in massive_positions(model, batch)]
    items = evaluation.load_mc_items() if cfg.mc else None

    base, ref = _measure(model, batch, [], layers, rank_layer, None)
    if items is not None:
        base["mc_accuracy"] = evaluation.score_choices(model, items).accuracy
    rows: list[dict[str, Any]] = []
    for v in cfg.variants:
        for r in cfg.rates:
            if r == 0:
                rows.append({"kind": "wemask", "variant": v, "rate": 0.0, "alpha": 1.0, **base})
    conds = _conditions(cfg)
    for kind, variant, rate, alpha in tqdm(conds, desc="wemask sweep", disable=None):
        if kind == "wemask":
            spec: Any = WeMask.build(model, layers, rate, variant, positions, seed=cfg.seed)
        elif kind == "dim_projection":
            spec = dim_projection(
                model, alpha, layers, variant=variant, rate=rate, positions=positions
            )
        else:
            spec = DirectionProjection.build(model, alpha, directions, layers, positions=positions)
        hooks = core.tl_hooks(spec)
        m, _ = _measure(model, batch, hooks, layers, rank_layer, ref)
        if items is not None:
            m["mc_accuracy"] = evaluation.score_choices(model, items, core.tl_hooks(spec)).accuracy
        rows.append({"kind": kind, "variant": variant, "rate": rate, "alpha": alpha, **m})
    return Result(
        model=model.name,
        bos=model.bos,
        me_layer=int(me),
        start=cfg.start,
        layers=layers,
        rank_layer=rank_layer,
        n_texts=len(batch),
        n_tokens=int(batch.attention_mask.sum()),
        baseline=base,
        rows=rows,
        positions=positions,
    )


def figures(result: Result) -> dict[str, go.Figure]:
    metrics = [m for m in (*METRICS, "mc_accuracy") if m in result.baseline]
    cols = 3
    nrows = (len(metrics) + cols - 1) // cols
    rate_fig = make_subplots(
        rows=nrows, cols=cols, subplot_titles=[METRIC_TITLES[m] for m in metrics]
    )
    variants = sorted({r["variant"] for r in result.rows if r["kind"] == "wemask"})
    colors = dict(zip(VARIANTS, ("firebrick", "darkorange", "gray", "steelblue")))
    for i, m in enumerate(metrics):
        rr, cc = i // cols + 1, i % cols + 1
        for v in variants:
            pts = sorted(
                (r["rate"], r[m])
                for r in result.rows
                if r["kind"] == "wemask" and r["variant"] == v
            )
            rate_fig.add_trace(
                go.Scatter(
                    x=[p[0] for p in pts],
                    y=[p[1] for p in pts],
                    mode="lines+markers",
                    name=v,
                    legendgroup=v,
                    showlegend=i == 0,
                    line_color=colors.get(v),
                ),
                row=rr,
                col=cc,
            )
        rate_fig.update_xaxes(title_text="mask rate r", row=rr, col=cc)
        if m == "perplexity":
            rate_fig.update_yaxes(type="log", row=rr, col=cc)
    rate_fig.update_layout(
        title=f"WeMask mask-rate study — {result.model}<br><sup>masked positions: {_pos_label(result.positions)}; layers "
        f"{result.layers[0]}..{result.layers[-1]} (ME layer {result.me_layer}, start '{result.start}')</sup>",
        template="plotly_white",
        height=330 * nrows + 120,
    )
    soft_fig = make_subplots(
        rows=nrows, cols=cols, subplot_titles=[METRIC_TITLES[m] for m in metrics]
    )
    kinds = [
        k
        for k in ("dim_projection", "direction_projection")
        if any(r["kind"] == k for r in result.rows)
    ]
    for i, m in enumerate(metrics):
        rr, cc = i // cols + 1, i % cols + 1
        for k in kinds:
            pts = [(0.0, result.baseline[m])]
            pts += sorted((r["alpha"], r[m]) for r in result.rows if r["kind"] == k)
            soft_fig.add_trace(
                go.Scatter(
                    x=[p[0] for p in pts],
                    y=[p[1] for p in pts],
                    mode="lines+markers",
                    name=k,
                    legendgroup=k,
                    showlegend=i == 0,
                ),
                row=rr,
                col=cc,
            )
        soft_fig.update_xaxes(title_text="α", row=rr, col=cc)
    soft_fig.update_layout(
        title=f"Soft alternatives: h − α P_S h (weight dims) and h − α proj_v h — {result.model}",
        template="plotly_white",
        height=330 * nrows + 120,
    )
    return {"mask_rate": rate_fig, "soft_alpha": soft_fig}


def verdicts(result: Result) -> list[dict[str, Any]]:
    """The paper's WeMask claims as tested here (``claim``, ``measured``, ``holds``)."""
    return [{k: v[k] for k in ("claim", "measured", "holds")} for v in result.verdict_list()]


def _pos_label(positions: Any) -> str:
    if positions and isinstance(positions[0], (list, tuple)):
        return "detected massive positions " + str(sorted({p for row in positions for p in row}))
    return str(list(positions))


def summary(result: Result) -> str:
    head = (
        f"model: {result.model}   ME layer {result.me_layer} (1-based {result.me_layer + 1}); masked "
        f"layers {result.layers[0]}..{result.layers[-1]} at positions {_pos_label(result.positions)}; {result.n_texts} texts, "
        f"{result.n_tokens} tokens"
    )
    metrics = [m for m in (*METRICS, "mc_accuracy") if m in result.baseline]
    rows = [("baseline", "-", "-", "-", *(result.baseline[m] for m in metrics))]
    rows += [
        (r["kind"], r["variant"], r["rate"], r["alpha"], *(r[m] for m in metrics))
        for r in result.rows
        if not (r["kind"] == "wemask" and r["rate"] == 0)
    ]
    table = fmt_table(["kind", "variant", "rate", "alpha", *metrics], rows)
    lines = [head, "", table, ""]
    for v in verdicts(result):
        mark = {True: "holds", False: "does not hold", None: "inconclusive"}[v["holds"]]
        lines.append(f"[{mark}] {v['claim']}: {v['measured']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    return cli_main(NAME, Config, run, figures, summary, argv, description=__doc__)


if __name__ == "__main__":
    raise SystemExit(main())
