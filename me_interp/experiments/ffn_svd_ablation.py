"""FFN singular-direction and neuron ablation at the ME layer: which directions make the massive activation?

With ``W = U diag(s) Vᵀ`` (``s`` descending), ``svd_ablated`` sets ``W ← W − Σ_{i<k} s_i u_i v_iᵀ``
for ``W`` one of ``W_down``, ``W_up``, ``W_gate`` of the ME layer ``m`` (``me_interp.edits.ffn``), for
each ``k`` of a sweep. Separately, the FFN neurons that write most into the massive dims are found by a
probe and ablated (gate row, up row and down column zeroed), one at a time and all together.

Neuron score (the probe): at the massive token ``t_b`` of each prompt ``b`` (the unedited ME layer's
massive position), ``score_n = mean_b ‖ act_n(b, t_b) · W_down[D, n] ‖₂`` with
``act = σ(W_gate x) ⊙ W_up x`` (``mlp.hook_post``) and ``D`` the massive dims: how much neuron ``n``
writes into the massive dims.

After each edit: does the massive activation *survive* (layer ``m``'s output still meets the massive
criterion), the new ME layer, the massive ratio ``R_l`` (max token / mean others) at ``m`` and at the
last layer, and the downstream attention sink. ``kill_k`` of a matrix is the smallest ``k`` after which
the massive activation no longer survives.

    python -m me_interp.experiments.ffn_svd_ablation
    python -m me_interp.experiments.ffn_svd_ablation --ks 1 2 4 --matrices down --n-neurons 5
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import plotly.graph_objects as go
import torch
from jaxtyping import Int
from tqdm.auto import tqdm

from me_interp import names
from me_interp.edits import MATRICES, ffn_matrix, neurons_ablated, singular_values, svd_ablated
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
from me_interp.models import Batch, LoadedModel

NAME = "ffn_svd_ablation"


@dataclass(frozen=True)
class Config(WeightConfig):
    """FFN-ablation settings.

    Attributes:
        matrices: which FFN matrices to ablate (down, up, gate).
        ks: how many top singular directions to remove (each value separately).
        n_neurons: how many of the top-scoring neurons to ablate (each alone, then all together).
        few: the verdict's "a few directions": the claim holds when some matrix loses the massive
            activation at ``k <= few``.
    """

    matrices: tuple[str, ...] = ("down", "up", "gate")
    ks: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    n_neurons: int = 3
    few: int = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        for mat in self.matrices:
            if mat not in MATRICES:
                raise ValueError(f"unknown FFN matrix {mat!r}; choose from {MATRICES}")
        for k in self.ks:
            if k < 1:
                raise ValueError(f"every k must be >= 1, got {k}")
        if not self.matrices and not self.n_neurons:
            raise ValueError("nothing to ablate: give matrices or n_neurons > 0")
        if self.n_neurons < 0 or self.few < 1:
            raise ValueError("n_neurons must be >= 0 and few >= 1")


def _record_act(act: torch.Tensor, hook, *, store: dict) -> torch.Tensor:
    store["act"] = act.detach().float()
    return act


def neuron_scores(
    model: LoadedModel,
    batch: Batch,
    layer: int,
    positions: Int[torch.Tensor, " batch"],
    dims: Sequence[int],
) -> torch.Tensor:
    """``score_n = mean_b ‖act_n(b, t_b) · W_down[D, n]‖₂`` (module docstring), shape ``[d_mlp]``.

    Raises:
        ValueError: no massive dims, or a dim out of range.
    """
    model.check_layer(layer)
    dims = list(dims)
    if not dims or not all(0 <= d < model.d_model for d in dims):
        raise ValueError(
            f"dims must be a non-empty list of dims in 0..{model.d_model - 1}, got {dims}"
        )
    store: dict = {}
    model.run_with_hooks(batch, [(names.site("ffn_act", layer), partial(_record_act, store=store))])
    act = store["act"][torch.arange(len(batch)), positions.to(store["act"].device)]  # [batch d_mlp]
    W = ffn_matrix(model, layer, "down").detach().float()[dims].to(act.device)  # [D d_mlp]
    writes = act[:, None, :] * W[None]  # [batch D d_mlp]
    return writes.norm(dim=1).mean(0).cpu()


@dataclass
class Result:
    model: str
    bos: str
    layer: int
    baseline: Measurement
    rows: list[dict[str, Any]]
    singular_values: dict[str, list[float]]
    neurons: list[int]
    neuron_scores: list[float]
    massive_dims: list[int]
    few: int
    n_prompts: int
    prompt_lengths: list[int]

    def kill_k(self, matrix: str) -> int | None:
        ks = [
            r["k"]
            for r in self.rows
            if r["kind"] == "svd" and r["matrix"] == matrix and not r["survives"]
        ]
        return min(ks) if ks else None

    def neuron_rows(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["kind"] == "neurons"]

    def headline(self) -> dict[str, Any]:
        mats = sorted({r["matrix"] for r in self.rows if r["kind"] == "svd"}, key=MATRICES.index)
        kills = {m: self.kill_k(m) for m in mats}
        nrows = self.neuron_rows()
        neurons_kill = any(not r["survives"] for r in nrows) if nrows else None
        if not mats and neurons_kill is None:
            return {"holds": None, "reason": "nothing was ablated"}
        svd_holds = any(k is not None and k <= self.few for k in kills.values())
        return {
            "holds": bool(svd_holds or neurons_kill),
            "kill_k": kills,
            "top_neurons_kill": neurons_kill,
            "rule": f"holds when removing at most {self.few} top singular directions of some FFN "
            "matrix, or the top neurons, removes the massive activation at the ME layer",
        }

    def to_dict(self) -> dict[str, Any]:
        b = self.baseline
        return {
            "claim": "The ME layer's FFN creates the massive activation through a few directions: "
            "removing the top singular directions of W_down / W_up / W_gate, or the top neurons, "
            "removes it.",
            "baseline": b.at_layer(self.layer),
            "intervened": {
                "svd": {
                    f"{r['matrix']}_k{r['k']}": {
                        "survives": r["survives"],
                        "ratio_at_layer": r["ratio_at_layer"],
                    }
                    for r in self.rows
                    if r["kind"] == "svd"
                },
                "neurons": {
                    str(r["neurons"]): {
                        "survives": r["survives"],
                        "ratio_at_layer": r["ratio_at_layer"],
                    }
                    for r in self.neuron_rows()
                },
            },
            "verdict": self.headline(),
            "model": self.model,
            "bos": self.bos,
            "index_convention": INDEX_CONVENTION,
            "layer": self.layer,
            "layer_1based": self.layer + 1,
            "massive_dims": self.massive_dims,
            "top_neurons": self.neurons,
            "top_neuron_scores": self.neuron_scores,
            "singular_values_top": self.singular_values,
            "n_prompts": self.n_prompts,
            "prompt_lengths": self.prompt_lengths,
            "rows": self.rows,
            "baseline_detail": b.to_dict(),
        }


def run(cfg: Config, model: LoadedModel | None = None) -> Result:
    """Ablate singular directions and top neurons of the ME layer's FFN and measure.

    Raises:
        ValueError: a ``k`` above the rank of a matrix (checked before any forward), ``n_neurons``
            above ``d_mlp``, a layer out of range, no ME layer found.
    """
    s = prepare(cfg, model)
    m = s.layer
    assert m is not None
    for mat in cfg.matrices:
        rank = min(ffn_matrix(s.model, m, mat).shape)
        if max(cfg.ks, default=0) > rank:
            raise ValueError(
                f"k={max(cfg.ks)} exceeds the rank of W_{mat} ({rank} singular directions)"
            )
    if cfg.n_neurons > s.model.d_mlp:
        raise ValueError(f"n_neurons={cfg.n_neurons} exceeds the FFN width d_mlp={s.model.d_mlp}")
    # without a massive activation (an explicit --layer on a model without one) score all dims
    dims = s.location.massive_dims or list(range(s.model.d_model))
    ref = torch.tensor([p[0] for p in s.positions])
    scores = neuron_scores(s.model, s.batch, m, ref, dims) if cfg.n_neurons else torch.zeros(0)
    top = scores.argsort(descending=True)[: cfg.n_neurons].tolist()
    conditions: list[tuple[str, Any]] = [("svd", (mat, k)) for mat in cfg.matrices for k in cfg.ks]
    conditions += [("neurons", [n]) for n in top]
    if len(top) > 1:
        conditions.append(("neurons", top))
    rows = []
    for kind, what in tqdm(conditions, desc=NAME, disable=None):
        ctx = (
            svd_ablated(s.model, m, what[0], what[1])
            if kind == "svd"
            else neurons_ablated(s.model, m, what)
        )
        with ctx:
            after = measure(s.model, s.batch, s.criterion, s.positions, cfg.sink)
        rows.append(
            edit_row(
                after,
                m,
                kind=kind,
                matrix=what[0] if kind == "svd" else None,
                k=what[1] if kind == "svd" else None,
                neurons=None if kind == "svd" else list(what),
            )
        )
    return Result(
        model=s.model.name,
        bos=s.model.bos,
        layer=m,
        baseline=s.baseline,
        rows=rows,
        singular_values={
            mat: singular_values(s.model, m, mat)[: max(cfg.ks, default=1)] for mat in cfg.matrices
        },
        neurons=top,
        neuron_scores=[float(scores[n]) for n in top],
        massive_dims=list(dims),
        few=cfg.few,
        n_prompts=len(s.batch),
        prompt_lengths=s.batch.lengths,
    )


def figures(result: Result) -> dict[str, go.Figure]:
    base = result.baseline.ratio_at(result.layer)
    fig = go.Figure()
    for mat in MATRICES:
        rows = [r for r in result.rows if r["kind"] == "svd" and r["matrix"] == mat]
        if rows:
            fig.add_trace(
                go.Scatter(
                    x=[r["k"] for r in rows],
                    y=[r["ratio_at_layer"] for r in rows],
                    mode="lines+markers",
                    name=f"W_{mat}",
                    hovertemplate="k=%{x}: ratio %{y:.4g}<extra>W_" + mat + "</extra>",
                )
            )
    fig.add_hline(y=base, line_dash="dash", line_color="gray", annotation_text="unedited")
    fig.update_layout(
        title=f"Massive ratio at layer {result.layer} after removing the top-k singular directions — {result.model}",
        xaxis_title="k (directions removed)",
        xaxis_type="log",
        yaxis_title="max token / mean others at the ME layer",
        yaxis_type="log",
        template="plotly_white",
    )
    nrows = result.neuron_rows()
    neu = go.Figure(
        go.Bar(
            x=[" + ".join(map(str, r["neurons"])) for r in nrows],
            y=[r["ratio_at_layer"] for r in nrows],
            marker_color=["seagreen" if r["survives"] else "firebrick" for r in nrows],
        )
    )
    neu.add_hline(y=base, line_dash="dash", line_color="gray")
    neu.update_layout(
        title=f"Ablating the top neurons of layer {result.layer} (by writes into dims {result.massive_dims[:4]})"
        "<br><sup>green: still massive; red: gone; dashed: unedited</sup>",
        xaxis_title="ablated neurons",
        yaxis_title="ratio at the ME layer",
        yaxis_type="log",
        template="plotly_white",
    )
    return {"svd_sweep": fig, "neuron_ablation": neu}


def verdicts(result: Result) -> list[dict[str, Any]]:
    head = result.headline()
    out = [
        {
            "claim": "Removing a few top singular directions of the ME layer's FFN removes the massive activation",
            "measured": "smallest k that removes it: "
            + ", ".join(
                f"W_{m}: {k if k is not None else 'none tested'}"
                for m, k in head.get("kill_k", {}).items()
            ),
            "holds": head["holds"] if head.get("kill_k") else None,
        }
    ]
    nrows = result.neuron_rows()
    if nrows:
        out.append(
            {
                "claim": "The top FFN neurons of the ME layer (found by the probe) create the massive activation",
                "measured": "; ".join(
                    f"ablate {r['neurons']}: ratio {r['ratio_at_layer']:.4g} ({'survives' if r['survives'] else 'gone'})"
                    for r in nrows
                ),
                "holds": head.get("top_neurons_kill"),
            }
        )
    return out


def summary(result: Result) -> str:
    rows = [
        (
            r["kind"],
            r["matrix"] or "-",
            r["k"] if r["k"] is not None else str(r["neurons"]),
            *edit_cells(r),
        )
        for r in result.rows
    ]
    head = result.headline()
    return "\n".join(
        [
            f"model: {result.model}   ME layer {result.layer} (1-based {result.layer + 1})   unedited ratio "
            f"{result.baseline.ratio_at(result.layer):.4g}   top neurons {result.neurons}",
            "",
            fmt_table(["edit", "matrix", "k/neurons", *EDIT_COLUMNS], rows),
            "",
            f"verdict: holds={head['holds']} (kill k {head.get('kill_k')}, top neurons kill "
            f"{head.get('top_neurons_kill')})",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    return cli_main(NAME, Config, run, figures, summary, argv, description=__doc__)


if __name__ == "__main__":
    raise SystemExit(main())
