"""RMSNorm permutation: does the massive activation survive when the ME layer's gain is scrambled?

``RMSNorm(h) = h / sqrt(mean(h²) + eps) ⊙ w``. The paper (§2 claim 2) says the pre-FFN gain ``w`` of
the ME layer puts token 0's energy on the dims with large ``|w|`` — an *alignment* of ``w`` with the
residual stream. This experiment edits ``w`` of the ME layer ``m`` (``me_interp.edits.gains``) and
locates the massive activation again:

* ``random``: ``w ← w[π]`` for ``n_random`` seeded uniform permutations (same values, other dims);
* ``top``: a permutation moving only the ``top_k`` largest-``|w|`` dims, each to a random other dim;
* ``flatten``: ``w ← mean(w) + α (w − mean(w))`` for each ``α`` in ``alphas`` (``α = 0``: constant gain).

Each edit is made on the pre-FFN norm (``ffn``, the test) and on the pre-attention norm (``attn``, the
control). The massive activation *survives* an edit when layer ``m``'s output still meets the massive
criterion. Measured per edit: the new ME layer, the massive ratio ``R_l`` (max token / mean of the
others) at ``m`` and at the last layer, and the downstream attention sink.

    python -m me_interp.experiments.rmsnorm_permutation
    python -m me_interp.experiments.rmsnorm_permutation --n-random 10 --top-k 4 --alphas 0 0.5
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots
from tqdm.auto import tqdm

from me_interp.edits import (
    NORMS,
    flattened_gain,
    gain,
    permuted_gain,
    random_permutation,
    top_dims,
    top_dims_permutation,
)
from me_interp.experiments._weights import (
    EDIT_COLUMNS,
    Measurement,
    WeightConfig,
    edit_cells,
    edit_row,
    measure,
    prepare,
)
from me_interp.experiments.common import INDEX_CONVENTION, cli_main, fmt_table
from me_interp.models import LoadedModel

NAME = "rmsnorm_permutation"


@dataclass(frozen=True)
class Config(WeightConfig):
    """RMSNorm-permutation settings.

    Attributes:
        n_random: how many seeded random permutations (seeds ``seed, seed+1, …``).
        top_k: how many of the largest-``|w|`` dims the ``top`` permutation moves.
        alphas: flattening strengths ``α`` (1 = unchanged, 0 = constant gain).
        norms: which norms to edit: ``ffn`` (pre-FFN, the test) and/or ``attn`` (control).
    """

    n_random: int = 5
    top_k: int = 8
    alphas: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75)
    norms: tuple[str, ...] = ("ffn", "attn")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_random < 0:
            raise ValueError(f"n_random must be >= 0, got {self.n_random}")
        if self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if not self.norms:
            raise ValueError("give at least one norm (ffn, attn)")
        for n in self.norms:
            if n not in NORMS:
                raise ValueError(f"unknown norm {n!r}; choose from {NORMS}")


@dataclass
class Result:
    model: str
    bos: str
    layer: int
    baseline: Measurement
    rows: list[dict[str, Any]]
    top_dims: dict[str, list[int]]
    n_prompts: int
    prompt_lengths: list[int]

    def select(self, norm: str, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["norm"] == norm and r["kind"] == kind]

    def survival(self, norm: str, kind: str) -> float | None:
        rows = self.select(norm, kind)
        return sum(r["survives"] for r in rows) / len(rows) if rows else None

    def median_ratio(self, norm: str, kind: str) -> float | None:
        rows = self.select(norm, kind)
        return statistics.median(r["ratio_at_layer"] for r in rows) if rows else None

    def headline(self) -> dict[str, Any]:
        test = self.survival("ffn", "random")
        control = self.survival("attn", "random")
        if test is None:
            return {"holds": None, "reason": "no random permutation of the pre-FFN gain was run"}
        holds = test <= 0.5 and (control is None or control >= 0.5)
        return {
            "holds": holds,
            "survival_ffn_random": test,
            "survival_attn_random": control,
            "ratio_ffn_random_median": self.median_ratio("ffn", "random"),
            "ratio_baseline": self.baseline.ratio_at(self.layer),
            "rule": "holds when the massive activation at the ME layer survives at most half of the "
            "random permutations of the pre-FFN gain and at least half of those of the pre-attention gain",
        }

    def to_dict(self) -> dict[str, Any]:
        b = self.baseline
        kinds = ("random", "top", "flatten")
        return {
            "claim": "The massive activation needs the ME layer's pre-FFN RMSNorm gain as it is "
            "(aligned with the residual stream): permuting or flattening it removes the massive "
            "activation, while the same edits of the pre-attention gain do not.",
            "baseline": b.at_layer(self.layer),
            "intervened": {
                f"{n}_{k}": {
                    "survival": self.survival(n, k),
                    "median_ratio_at_layer": self.median_ratio(n, k),
                }
                for n in ("ffn", "attn")
                for k in kinds
                if self.select(n, k)
            },
            "verdict": self.headline(),
            "model": self.model,
            "bos": self.bos,
            "index_convention": INDEX_CONVENTION,
            "layer": self.layer,
            "layer_1based": self.layer + 1,
            "top_dims": self.top_dims,
            "n_prompts": self.n_prompts,
            "prompt_lengths": self.prompt_lengths,
            "rows": self.rows,
            "baseline_detail": b.to_dict(),
        }


def _edits(model: LoadedModel, cfg: Config, layer: int) -> Iterator[tuple[str, str, Any, Any]]:
    """(norm, kind, parameter, context manager) for every edit of the run."""
    for norm in cfg.norms:
        w = gain(model, layer, norm)
        for i in range(cfg.n_random):
            perm = random_permutation(w.numel(), cfg.seed + i)
            yield norm, "random", cfg.seed + i, permuted_gain(model, layer, perm, norm)
        perm = top_dims_permutation(w, cfg.top_k, cfg.seed)
        yield norm, "top", cfg.top_k, permuted_gain(model, layer, perm, norm)
        for a in cfg.alphas:
            yield norm, "flatten", float(a), flattened_gain(model, layer, a, norm)


def run(cfg: Config, model: LoadedModel | None = None) -> Result:
    """Permute / flatten the ME layer's RMSNorm gains and measure. No printing, no files.

    Raises:
        ValueError: ``top_k`` above half of ``d_model``, a layer out of range, no ME layer found.
    """
    s = prepare(cfg, model)
    m = s.layer
    assert m is not None
    d = s.model.d_model
    if cfg.top_k > d // 2:
        raise ValueError(f"top_k must be at most d_model/2 = {d // 2}, got {cfg.top_k}")
    n_edits = len(cfg.norms) * (cfg.n_random + 1 + len(cfg.alphas))
    rows = []
    for norm, kind, param, ctx in tqdm(
        _edits(s.model, cfg, m), total=n_edits, desc=NAME, disable=None
    ):
        with ctx:
            after = measure(s.model, s.batch, s.criterion, s.positions, cfg.sink)
        rows.append(edit_row(after, m, norm=norm, kind=kind, param=param))
    return Result(
        model=s.model.name,
        bos=s.model.bos,
        layer=m,
        baseline=s.baseline,
        rows=rows,
        top_dims={n: top_dims(gain(s.model, m, n), cfg.top_k) for n in cfg.norms},
        n_prompts=len(s.batch),
        prompt_lengths=s.batch.lengths,
    )


def figures(result: Result) -> dict[str, go.Figure]:
    norms = sorted({r["norm"] for r in result.rows}, key=["ffn", "attn"].index)
    titles = {"ffn": "pre-FFN gain (test)", "attn": "pre-attention gain (control)"}
    fig = make_subplots(
        rows=1, cols=len(norms), subplot_titles=[titles[n] for n in norms], shared_yaxes=True
    )
    base = result.baseline.ratio_at(result.layer)
    for c, norm in enumerate(norms, start=1):
        rows = [r for r in result.rows if r["norm"] == norm]
        labels = [f"{r['kind']} {r['param']}" for r in rows]
        fig.add_trace(
            go.Bar(
                x=labels,
                y=[r["ratio_at_layer"] for r in rows],
                marker_color=["seagreen" if r["survives"] else "firebrick" for r in rows],
                name=titles[norm],
                showlegend=False,
                hovertemplate="%{x}<br>ratio at the ME layer %{y:.4g}<extra></extra>",
            ),
            row=1,
            col=c,
        )
        fig.add_hline(y=base, line_dash="dash", line_color="gray", row=1, col=c)
    fig.update_yaxes(type="log", title_text="max token / mean others at the ME layer", col=1)
    fig.update_layout(
        title=f"Massive ratio at layer {result.layer} after editing its RMSNorm gain — {result.model}"
        "<br><sup>green: still massive; red: gone; dashed: unedited</sup>",
        template="plotly_white",
    )
    flat = go.Figure()
    for norm in norms:
        rows = result.select(norm, "flatten")
        flat.add_trace(
            go.Scatter(
                x=[r["param"] for r in rows] + [1.0],
                y=[r["ratio_at_layer"] for r in rows] + [base],
                mode="lines+markers",
                name=titles[norm],
            )
        )
    flat.update_layout(
        title=f"Flattening w → mean + α (w − mean) at layer {result.layer} — {result.model}",
        xaxis_title="α (1 = unchanged)",
        yaxis_title="massive ratio at the ME layer",
        yaxis_type="log",
        template="plotly_white",
    )
    return {"ratio_after_edit": fig, "flatten_sweep": flat}


def verdicts(result: Result) -> list[dict[str, Any]]:
    head = result.headline()
    out = [
        {
            "claim": "Permuting the ME layer's pre-FFN RMSNorm gain removes the massive activation; "
            "permuting the pre-attention gain does not (RMSNorm alignment)",
            "measured": f"survival under random permutations: pre-FFN {head.get('survival_ffn_random')}, "
            f"pre-attention {head.get('survival_attn_random')}; median ratio "
            f"{_fmt(head.get('ratio_ffn_random_median'))} vs {_fmt(result.baseline.ratio_at(result.layer))} unedited",
            "holds": head["holds"],
        }
    ]
    top = result.survival("ffn", "top")
    if top is not None:
        out.append(
            {
                "claim": "Moving only the top-|w| dims of the pre-FFN gain removes the massive activation",
                "measured": f"survives: {bool(top)}; ratio {_fmt(result.median_ratio('ffn', 'top'))} "
                f"(dims {result.top_dims.get('ffn')})",
                "holds": not top,
            }
        )
    flat = result.select("ffn", "flatten")
    if flat:
        zero = [r for r in flat if r["param"] == 0.0]
        out.append(
            {
                "claim": "Flattening the pre-FFN gain to a constant (α = 0) removes the massive activation",
                "measured": ", ".join(f"α={r['param']}: {_fmt(r['ratio_at_layer'])}" for r in flat),
                "holds": (not zero[0]["survives"]) if zero else None,
            }
        )
    return out


def _fmt(x: Any) -> str:
    return "n/a" if x is None else f"{x:.4g}"


def summary(result: Result) -> str:
    rows = [(r["norm"], r["kind"], r["param"], *edit_cells(r)) for r in result.rows]
    head = result.headline()
    return "\n".join(
        [
            f"model: {result.model}   ME layer {result.layer} (1-based {result.layer + 1})   unedited ratio "
            f"{result.baseline.ratio_at(result.layer):.4g}",
            "",
            fmt_table(["norm", "edit", "param", *EDIT_COLUMNS], rows),
            "",
            f"verdict: holds={head['holds']} (survival pre-FFN {head.get('survival_ffn_random')}, "
            f"pre-attention {head.get('survival_attn_random')})",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    return cli_main(NAME, Config, run, figures, summary, argv, description=__doc__)


if __name__ == "__main__":
    raise SystemExit(main())
