"""Weight patching: copy one component's weights from a source layer (or model) into a target layer.

``θ_target^part ← θ_source^part`` (:func:`me_interp.edits.patched_weights`) for each part
(``attn_norm``, ``ffn_norm``, ``ffn``, ``attn``, ``block``) and each target layer, then the massive
activation is located again. Unlike a swap, the source layer keeps its own weights, so this asks
whether a component is *sufficient* to create the emergence where it is copied (``copied``: the new ME
layer is the target), and, when the source is another layer of the same model, whether overwriting
the ME layer's part *removes* it (``vanished``).

The source is ``--layer`` (default: the ME layer of the source model; ``--source-model`` loads a
second model of the same shape like ``--model``, and its ME layer is the default source). Targets
default to every other layer (one model) or to the source layer's index (two models). Measured per
patch: the new ME layer, the massive ratio ``R_l`` (max token / mean others) at the target, at the
baseline ME layer and at the last layer, and the downstream attention sink.

    python -m me_interp.experiments.weight_patching
    python -m me_interp.experiments.weight_patching --model synthetic:twin --source-model synthetic:planted
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import plotly.graph_objects as go
from tqdm.auto import tqdm

from me_interp.edits import PARTS, check_part, patched_weights
from me_interp.experiments._weights import (
    Measurement,
    WeightConfig,
    check_layers,
    locate,
    measure,
    prepare,
    short_batch,
)
from me_interp.experiments.common import INDEX_CONVENTION, cli_main, fmt_table
from me_interp.models import LoadedModel, load_model

NAME = "weight_patching"


@dataclass(frozen=True)
class Config(WeightConfig):
    """Weight-patching settings (``layer`` is the *source* layer).

    Attributes:
        targets: layers to patch into (``()``: every other layer; with a source model, the source
            layer's index).
        parts: the components to copy, each separately.
        source_model: a second model of the same shape to copy from (loaded like ``--model``);
            ``None`` = copy within the model.
    """

    targets: tuple[int, ...] = ()
    parts: tuple[str, ...] = PARTS
    source_model: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.parts:
            raise ValueError(f"give at least one part to patch ({', '.join(PARTS)})")
        for p in self.parts:
            check_part(p)


@dataclass
class Result:
    model: str
    source_model: str
    bos: str
    source_layer: int
    targets: list[int]
    parts: list[str]
    baseline: Measurement
    rows: list[dict[str, Any]]
    n_prompts: int
    prompt_lengths: list[int]

    def fraction(self, part: str, outcome: str) -> float:
        rows = [r for r in self.rows if r["part"] == part]
        return sum(r["outcome"] == outcome for r in rows) / max(len(rows), 1)

    def headline(self) -> dict[str, Any]:
        copied = {p: self.fraction(p, "copied") for p in self.parts}
        best = max(self.parts, key=lambda p: copied[p])
        return {
            "holds": copied[best] >= 0.5,
            "part": best,
            "copied_fraction": round(copied[best], 4),
            "rule": "holds when copying some part of the source layer makes the target the ME layer "
            "for at least half of the targets",
        }

    def to_dict(self) -> dict[str, Any]:
        b = self.baseline
        return {
            "claim": "The weights of the source (ME) layer suffice to create the massive activation: "
            "copying its FFN path (or block) into a target layer makes the emergence appear there.",
            "baseline": {
                "me_layer": b.me_layer,
                "ratio_at_targets": {t: b.ratio_at(t) for t in self.targets},
                "ratio_last": b.top_ratio[-1],
                "sink_downstream": b.sink_after(b.me_layer),
            },
            "intervened": {
                p: {
                    "copied": self.fraction(p, "copied"),
                    "kept": self.fraction(p, "kept"),
                    "vanished": self.fraction(p, "vanished"),
                    "elsewhere": self.fraction(p, "elsewhere"),
                    "me_layers": [r["me_layer"] for r in self.rows if r["part"] == p],
                }
                for p in self.parts
            },
            "verdict": self.headline(),
            "model": self.model,
            "source_model": self.source_model,
            "bos": self.bos,
            "index_convention": INDEX_CONVENTION,
            "source_layer": self.source_layer,
            "source_layer_1based": self.source_layer + 1,
            "targets": self.targets,
            "parts": self.parts,
            "n_prompts": self.n_prompts,
            "prompt_lengths": self.prompt_lengths,
            "rows": self.rows,
            "baseline_detail": b.to_dict(),
        }


def outcome(me_after: int | None, me_before: int | None, target: int) -> str:
    """``copied`` (ME layer = target), ``kept`` (= the unpatched ME layer), ``vanished`` or ``elsewhere``."""
    if me_after is None:
        return "vanished"
    if me_after == target:
        return "copied"
    return "kept" if me_after == me_before else "elsewhere"


def _source_layer(cfg: Config, source: LoadedModel, target_me: int | None) -> int:
    if cfg.layer is not None:
        return source.check_layer(cfg.layer)
    batch = short_batch(source, cfg.load_prompts(), cfg.n_prompts, cfg.max_tokens)
    me = locate(source, batch, cfg.detection()).me_layer
    if me is None:
        me = target_me
    if me is None:
        raise ValueError(f"no ME layer found in the source model {source.name}: pass --layer")
    return me


def run(
    cfg: Config, model: LoadedModel | None = None, source_model: LoadedModel | None = None
) -> Result:
    """Copy each part of the source layer into each target layer and measure. No printing, no files.

    Args:
        source_model: an already loaded source model (else ``cfg.source_model`` is loaded).

    Raises:
        ValueError: a layer out of range, models of different shapes, a target equal to the source
            layer within one model, no ME layer to default to.
    """
    s = prepare(cfg, model, require_layer=False)
    target = s.model
    if source_model is None and cfg.source_model is not None:
        source_model = load_model(cfg.source_model, bos=cfg.bos, dtype=cfg.dtype, device=cfg.device)
    src = source_model if source_model is not None else target
    if src is not target and (src.n_layers, src.d_model) != (target.n_layers, target.d_model):
        raise ValueError(
            f"the source model has {src.n_layers} layers × d_model {src.d_model}, the model "
            f"{target.n_layers} × {target.d_model}: weight patching needs models of the same shape"
        )
    source_layer = _source_layer(cfg, src, s.location.me_layer)
    if cfg.targets:
        targets = check_layers(target, cfg.targets, "--targets")
        if src is target and source_layer in targets:
            raise ValueError(
                f"--targets contains the source layer {source_layer}: patching a layer onto itself changes nothing"
            )
    elif src is target:
        targets = [t for t in range(target.n_layers) if t != source_layer]
    else:
        targets = [source_layer]
    me0 = s.baseline.me_layer
    rows = []
    todo = [(part, t) for part in cfg.parts for t in targets]
    for part, t in tqdm(todo, desc=f"{NAME} (source layer {source_layer})", disable=None):
        with patched_weights(
            target, source_layer, t, part, source_model=None if src is target else src
        ):
            after = measure(target, s.batch, s.criterion, s.positions, cfg.sink)
        rows.append(
            {
                "part": part,
                "target": t,
                "me_layer": after.me_layer,
                "outcome": outcome(after.me_layer, me0, t),
                "event_layers": after.event_layers,
                "ratio_at_target": after.ratio_at(t),
                "ratio_at_target_before": s.baseline.ratio_at(t),
                "ratio_at_me_before": None if me0 is None else after.ratio_at(me0),
                "ratio_last": after.top_ratio[-1],
                "sink_downstream": after.sink_after(me0 if me0 is not None else t),
                "top_ratio": after.top_ratio,
            }
        )
    return Result(
        model=target.name,
        source_model=src.name,
        bos=target.bos,
        source_layer=source_layer,
        targets=targets,
        parts=list(cfg.parts),
        baseline=s.baseline,
        rows=rows,
        n_prompts=len(s.batch),
        prompt_lengths=s.batch.lengths,
    )


def figures(result: Result) -> dict[str, go.Figure]:
    xs = [str(t) for t in result.targets]
    index = {(r["part"], r["target"]): r for r in result.rows}
    me = [[index[(p, t)]["me_layer"] for t in result.targets] for p in result.parts]
    ratio = [[index[(p, t)]["ratio_at_target"] for t in result.targets] for p in result.parts]
    src = "" if result.source_model == result.model else f" of {result.source_model}"
    fig = go.Figure(
        go.Heatmap(
            z=[[-1 if v is None else v for v in row] for row in me],
            x=xs,
            y=result.parts,
            text=[["none" if v is None else str(v) for v in row] for row in me],
            texttemplate="%{text}",
            customdata=ratio,
            colorscale="Viridis",
            zmin=-1,
            colorbar_title="ME layer<br>(-1: none)",
            hovertemplate="copy %{y} into layer %{x}<br>ME layer after: %{text}<br>ratio at the target "
            "%{customdata:.4g}<extra></extra>",
        )
    )
    fig.update_layout(
        title=f"ME layer after copying layer {result.source_layer}{src}'s part into the target — {result.model}"
        f"<br><sup>unpatched ME layer {result.baseline.me_layer} (0-based)</sup>",
        xaxis_title="target layer (0-based)",
        yaxis_title="copied part",
        template="plotly_white",
    )
    return {"me_layer_after_patch": fig}


def verdicts(result: Result) -> list[dict[str, Any]]:
    head = result.headline()
    out = [
        {
            "claim": "Copying the ME layer's weights into another layer makes the emergence appear there",
            "measured": f"best part {head['part']}: target became the ME layer for "
            f"{head['copied_fraction']:.0%} of {len(result.targets)} targets",
            "holds": head["holds"],
        }
    ]
    for p in result.parts:
        out.append(
            {
                "claim": f"Copying the source layer's {p} into a target makes the target the ME layer",
                "measured": f"copied {result.fraction(p, 'copied'):.0%}, kept {result.fraction(p, 'kept'):.0%}, "
                f"vanished {result.fraction(p, 'vanished'):.0%}, elsewhere {result.fraction(p, 'elsewhere'):.0%}",
                "holds": result.fraction(p, "copied") >= 0.5,
            }
        )
    return out


def summary(result: Result) -> str:
    rows = [
        (p, *(f"{result.fraction(p, o):.0%}" for o in ("copied", "kept", "vanished", "elsewhere")))
        for p in result.parts
    ]
    head = result.headline()
    return "\n".join(
        [
            f"model: {result.model}   source: {result.source_model} layer {result.source_layer}   "
            f"unpatched ME layer {result.baseline.me_layer}   targets {result.targets}",
            "",
            fmt_table(["part", "copied", "kept", "vanished", "elsewhere"], rows),
            "",
            f"verdict: holds={head['holds']} ({head['part']}: copied {head['copied_fraction']})",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    return cli_main(NAME, Config, run, figures, summary, argv, description=__doc__)


if __name__ == "__main__":
    raise SystemExit(main())
