"""Directional invariance: does the massive token point the same way for every input and every layer?

Tests paper.md §2 claim 4 (``probes.invariance``): per layer, the mean cosine of the massive token's layer
output across inputs **with different first tokens**, next to the trivial control (the same prompts with
their first token replaced by prompt 0's, so position 0 is identical across inputs by construction);
the same for the massive token's key per key/value head; cosine across layers; and norm stability
(coefficient of variation of ``‖h_m‖`` across inputs). The ME layer and massive tokens are detected.

    python -m me_interp.experiments.invariance                 # bundled model, built-in prompts

If every prompt starts with the same token (e.g. ``--bos yes``), only the control exists and the
verdict is inconclusive. ``result.json`` keys are documented in docs/probes.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import plotly.graph_objects as go

from me_interp import plotting
from me_interp.experiments.common import (
    cli_main,
    fmt_verdicts,
    model_for,
)
from me_interp.experiments.mechanism import DetectConfig, LayerReport, detect
from me_interp.models import LoadedModel
from me_interp.probes.invariance import invariance_scan, same_first_token_control

NAME = "invariance"


@dataclass(frozen=True)
class Config(DetectConfig):
    """Invariance settings.

    Attributes:
        threshold: cosine above which a direction counts as invariant in the verdicts.
    """

    threshold: float = 0.9

    def __post_init__(self) -> None:
        super().__post_init__()
        if not -1.0 < self.threshold < 1.0:
            raise ValueError("threshold must be a cosine in (-1, 1)")


@dataclass
class Result(LayerReport):
    reference_positions: list[int]
    first_tokens: list[int]
    n_pairs_distinct: int
    n_pairs_same: int
    threshold: float
    cos_across_layers: list[list[float]]
    verdicts: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.header(),
            "n_prompts": self.n_prompts,
            "reference_positions": self.reference_positions,
            "first_tokens": self.first_tokens,
            "n_pairs_distinct_first_token": self.n_pairs_distinct,
            "n_pairs_same_first_token": self.n_pairs_same,
            "threshold": self.threshold,
            "verdicts": self.verdicts,
            "layers": self.layers,
            "cos_across_layers": self.cos_across_layers,
        }


def run(cfg: Config, model: LoadedModel | None = None) -> Result:
    """Measure directional invariance at every layer. No printing, no files."""
    model = model_for(cfg, model)
    batch = model.tokenize(cfg.load_prompts())
    if len(batch) < 2:
        raise ValueError("the invariance experiment compares inputs: give at least 2 prompts")
    loc, ref = detect(model, batch, cfg.criterion, cfg.position)
    scan = invariance_scan(model, batch, positions=ref)
    ctrl = invariance_scan(model, same_first_token_control(batch), positions=ref)
    cos_d = scan.cos_across_inputs(False)
    cos_s = scan.cos_across_inputs(True)
    cos_c = ctrl.cos_across_inputs(True)
    kd = scan.key_cos_across_inputs(False)
    kc = ctrl.key_cos_across_inputs(True)
    cal = scan.cos_across_layers()
    cv = scan.norm_cv()
    norms = scan.mean_norm()
    L = scan.n_layers
    layers = [
        {
            "layer": i,
            "layer_1based": i + 1,
            "cos_across_inputs": cos_d[i],
            "cos_across_inputs_same_first_token": cos_s[i],
            "cos_across_inputs_control": cos_c[i],
            "key_cos_across_inputs": kd[i],
            "key_cos_across_inputs_control": kc[i],
            "cos_next_layer": float(cal[i, i + 1]) if i + 1 < L else float("nan"),
            "cos_to_me_layer": float(cal[i, loc.me_layer])
            if loc.me_layer is not None
            else float("nan"),
            "norm_cv": cv[i],
            "mean_norm": norms[i],
        }
        for i in range(L)
    ]
    result = Result(
        model=model.name,
        bos=model.bos,
        bos_prepended=model.bos_prepended(batch),
        n_prompts=len(batch),
        me_layer=loc.me_layer,
        reference_positions=[int(r) for r in scan.reference],
        first_tokens=scan.first_tokens,
        n_pairs_distinct=scan.n_pairs(False),
        n_pairs_same=scan.n_pairs(True),
        threshold=cfg.threshold,
        layers=layers,
        cos_across_layers=cal.tolist(),
    )
    result.verdicts = verdicts(result)
    return result


def _finite(xs) -> list[float]:
    return [x for x in xs if isinstance(x, float) and math.isfinite(x)]


def verdicts(result: Result) -> list[dict]:
    """Claim 4 on this model (None when no ME layer or no pair of inputs with different first tokens)."""
    me, thr = result.me_layer, result.threshold
    if me is None:
        return [
            {
                "claim": "After the ME layer the massive token points the same way for every input",
                "measured": "no ME layer detected: nothing to test",
                "holds": None,
            }
        ]
    after = range(me, len(result.layers))
    before = range(0, me)
    out = []
    if result.n_pairs_distinct == 0:
        ctrl = _finite([result.layers[i]["cos_across_inputs_control"] for i in after])
        out.append(
            {
                "claim": "After the ME layer the massive token's hidden state points the same way for "
                "inputs with different first tokens (cos ≈ 1)",
                "measured": "every prompt starts with the same token, so cos ≈ 1 is automatic "
                f"(control min {min(ctrl):.4g}); no evidence either way"
                if ctrl
                else "every prompt starts with the same token; no evidence either way",
                "holds": None,
            }
        )
    else:
        cd = [result.layers[i]["cos_across_inputs"] for i in after]
        pre = _finite([result.layers[i]["cos_across_inputs"] for i in before])
        out.append(
            {
                "claim": "After the ME layer the massive token's hidden state points the same way for "
                f"inputs with different first tokens (cos > {thr} at every layer ≥ ME)",
                "measured": f"min cos over layers {me}..{len(result.layers) - 1} = {min(cd):.4g} "
                f"({result.n_pairs_distinct} pairs); before ME mean {sum(pre) / len(pre):.3g}"
                if pre
                else f"min cos over layers ≥ {me} = {min(cd):.4g} ({result.n_pairs_distinct} pairs)",
                "holds": min(cd) > thr,
            }
        )
        kd = [min(result.layers[i]["key_cos_across_inputs"]) for i in after]
        out.append(
            {
                "claim": f"After the ME layer the massive token's key k_m points the same way for every "
                f"input, in every key/value head (cos > {thr})",
                "measured": f"min over layers ≥ {me} and heads = {min(kd):.4g}",
                "holds": min(kd) > thr,
            }
        )
    ca = [result.cos_across_layers[me][i] for i in after]
    last = me
    while last + 1 < len(result.layers) and result.cos_across_layers[me][last + 1] > thr:
        last += 1
    out.append(
        {
            "claim": "After the ME layer the residual stream carries the massive token's direction "
            f"unchanged across layers (cos(h^ME, h^l) > {thr})",
            "measured": f"min cos(h^{me}, h^l) over l ≥ {me} = {min(ca):.4g}; cos > {thr} from layer "
            f"{me} to layer {last} (of {len(result.layers) - 1}); "
            f"norm CV across inputs at ME = {result.layers[me]['norm_cv']:.3g}",
            "holds": min(ca) > thr,
        }
    )
    return out


def figures(result: Result) -> dict[str, go.Figure]:
    me = result.me_layer
    cos = plotting.layer_lines(
        {
            f"different first tokens ({result.n_pairs_distinct} pairs)": result.series(
                "cos_across_inputs"
            ),
            "control: first token made identical": result.series("cos_across_inputs_control"),
        },
        "Cosine of the massive token's layer output across inputs (mean over pairs)",
        "cosine (1 = same direction)",
        me,
    )
    kd = result.series("key_cos_across_inputs")
    heads = len(kd[0]) if kd else 0
    key = plotting.layer_lines(
        {f"kv head {h}": [row[h] for row in kd] for h in range(heads)},
        "Cosine of the massive token's key k_m across inputs with different first tokens, per key/value head",
        "cosine (1 = same direction)",
        me,
    )
    n = len(result.cos_across_layers)
    heat = go.Figure(
        go.Heatmap(
            z=result.cos_across_layers,
            x=list(range(n)),
            y=list(range(n)),
            zmin=-1,
            zmax=1,
            colorscale="RdBu",
            colorbar_title="cos",
            hovertemplate="layer %{y} vs layer %{x}: cos %{z:.4f}<extra></extra>",
        )
    )
    heat.update_layout(
        title="Cosine of the massive token's state between layers (mean over prompts)"
        + (f"; ME layer {me} (1-based {me + 1})" if me is not None else ""),
        xaxis_title="layer (0-based)",
        yaxis_title="layer (0-based)",
        template="plotly_white",
    )
    norm = plotting.layer_lines(
        {"std / mean of ‖h_m‖ across inputs": result.series("norm_cv")},
        "Norm stability of the massive token across inputs (coefficient of variation)",
        "coefficient of variation (dimensionless)",
        me,
    )
    return {
        "cos_across_inputs": cos,
        "key_cos_across_inputs": key,
        "cos_across_layers": heat,
        "norm_stability": norm,
    }


def summary(result: Result) -> str:
    head = (
        f"model: {result.model}   bos: {result.bos}   prompts: {result.n_prompts}   "
        f"pairs with different first tokens: {result.n_pairs_distinct}   ME layer: "
        + result.me_text()
    )
    table = result.layer_table(
        ["cos inputs", "control", "min key cos", "cos next", "norm CV"],
        lambda r: (
            r["cos_across_inputs"],
            r["cos_across_inputs_control"],
            min(r["key_cos_across_inputs"]),
            r["cos_next_layer"],
            r["norm_cv"],
        ),
    )
    ver = fmt_verdicts(result.verdicts)
    return "\n\n".join([head, table, ver])


def main(argv: Sequence[str] | None = None) -> int:
    return cli_main(NAME, Config, run, figures, summary, argv, description=__doc__)


if __name__ == "__main__":
    raise SystemExit(main())
