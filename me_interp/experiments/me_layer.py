"""ME-layer report: where are massive activations born, in which dims and positions, by which sub-layer?

Runs the prompts once, records token norms at every site of every layer (``probes.norms``), detects
massive activations over all positions (``probes.massive``) and localises the ME layer and every
emergence event (0-based and 1-based). Writes ``result.json`` with ``model``, ``bos``, ``me_layer``,
``me_layer_1based``, ``events``, ``massive_positions``, ``massive_dims`` and per-layer
``resid_norm_ratio``, ``ffn_out_norm_ratio``, ``max_over_median``; and two figures: the Figure-1 view
(massive-token norm vs the others at each site) and a token × dimension view of the ME layer's output.

    python -m me_interp.experiments.me_layer                # bundled model, built-in prompts
    python -m me_interp.experiments.me_layer --model Qwen/Qwen3-4B --device cuda --criterion either
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from me_interp import names, plotting
from me_interp.experiments.common import (
    INDEX_CONVENTION,
    CommonConfig,
    cli_main,
    fmt_table,
    model_for,
)
from me_interp.models import LoadedModel
from me_interp.probes.massive import Criterion, MELocation, locate_me_layer
from me_interp.probes.norms import NormScan, scan_norms

NAME = "me_layer"


@dataclass(frozen=True)
class Config(CommonConfig):
    """ME-layer scan settings (see ``probes.massive`` for the criterion).

    Attributes:
        criterion: massive-activation criterion: ``sun`` (value thresholds), ``norm`` (token-norm
            ratio), ``either`` or ``both``.
        abs_threshold: ``sun`` criterion: a value is massive when ``|a|`` exceeds this absolute
            threshold (and the relative one).
        rel_threshold: ``sun`` criterion: ... and ``|a|`` is at least this many times the median
            ``|a|`` of the layer output.
        norm_ratio: ``norm`` criterion: a token is massive when its layer-output norm is at least this
            many times the median norm of the other tokens.
        min_prompt_fraction: a layer counts as massive when at least this fraction of the prompts has
            a massive token there, in (0, 1].
        top_k: how many of each token's largest ``|a|`` values the scan keeps per site (>= 1).
    """

    criterion: str = "sun"
    abs_threshold: float = 100.0
    rel_threshold: float = 1000.0
    norm_ratio: float = 50.0
    min_prompt_fraction: float = 0.5
    top_k: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        self.detection()  # validates
        if self.top_k < 1:
            raise ValueError("top_k must be >= 1")

    def detection(self) -> Criterion:
        return Criterion(
            kind=self.criterion,  # type: ignore[arg-type]
            abs_threshold=self.abs_threshold,
            rel_threshold=self.rel_threshold,
            norm_ratio=self.norm_ratio,
            min_prompt_fraction=self.min_prompt_fraction,
        )


@dataclass
class Result:
    model: str
    bos: str
    bos_prepended: bool
    n_prompts: int
    location: MELocation
    site_norms: dict[str, dict[str, list[float]]]
    heatmap_tokens: list[str]
    heatmap_values: list[list[float]]
    heatmap_layer: int
    prompt_lengths: list[int] = field(default_factory=list)

    @property
    def me_layer(self) -> int | None:
        return self.location.me_layer

    def to_dict(self) -> dict[str, Any]:
        loc = self.location
        ratios = loc.site_ratios
        n = len(loc.top_ratio)
        return {
            "model": self.model,
            "bos": self.bos,
            "bos_prepended": self.bos_prepended,
            "index_convention": INDEX_CONVENTION,
            "me_layer": loc.me_layer,
            "me_layer_1based": loc.me_layer_1based,
            "me_site": loc.me_event.site if loc.me_event else None,
            "events": [e.to_dict() for e in loc.events],
            "massive_positions": loc.massive_positions,
            "massive_dims": loc.massive_dims,
            "reference_positions": loc.reference_positions,
            "criterion": loc.criterion.to_dict(),
            "n_prompts": self.n_prompts,
            "prompt_lengths": self.prompt_lengths,
            "layers": [
                {
                    "layer": i,
                    "layer_1based": i + 1,
                    "resid_norm_ratio": ratios["resid_post"][i],
                    "ffn_out_norm_ratio": ratios["ffn_out"][i],
                    "ffn_in_norm_ratio": ratios["ffn_in"][i],
                    "attn_out_norm_ratio": ratios["attn_out"][i],
                    "attn_in_norm_ratio": ratios["attn_in"][i],
                    "top_norm_ratio": loc.top_ratio[i],
                    "max_over_median": loc.max_over_median[i],
                    "has_massive": loc.layer_has_massive[i],
                    "prompt_fraction": loc.prompt_fraction[i],
                }
                for i in range(n)
            ],
            "site_norms": self.site_norms,
        }


def _site_norms(scan: NormScan, reference: Sequence[int]) -> dict[str, dict[str, list[float]]]:
    """Median over prompts of the reference token's norm and of the other tokens' mean norm."""
    ref = torch.as_tensor(list(reference))
    idx = torch.arange(len(ref))
    others = scan.mask.clone()
    others[idx, ref] = False
    out = {}
    for s in scan.sites:
        n = scan.site_norms(s)  # [layer batch pos]
        mass = n[:, idx, ref]
        other = torch.where(others, n, torch.zeros(())).sum(-1) / others.sum(-1).clamp(min=1)
        out[s] = {
            "massive": mass.median(-1).values.tolist(),
            "others": other.median(-1).values.tolist(),
        }
    return out


def run(cfg: Config, model: LoadedModel | None = None) -> Result:
    """Scan the prompts and localise the ME layer. No printing, no files."""
    model = model_for(cfg, model)
    prompts = cfg.load_prompts()
    batch = model.tokenize(prompts)
    scan = scan_norms(model, batch, names.SITES, top_k=cfg.top_k, keep_prompt=0)
    loc = locate_me_layer(scan, cfg.detection())
    layer = loc.me_layer if loc.me_layer is not None else int(torch.tensor(loc.top_ratio).argmax())
    n0 = batch.lengths[0]
    tokens = [model.tokenizer.decode([int(t)]) for t in batch.tokens[0, :n0]]
    return Result(
        model=model.name,
        bos=model.bos,
        bos_prepended=model.bos_prepended(batch),
        n_prompts=len(prompts),
        location=loc,
        site_norms=_site_norms(scan, loc.reference_positions),
        heatmap_tokens=tokens,
        heatmap_values=scan.kept_resid[layer].tolist(),
        heatmap_layer=layer,
        prompt_lengths=batch.lengths,
    )


def figures(result: Result) -> dict[str, Any]:
    loc = result.location
    sites = ["attn_in", "attn_out", "ffn_in", "ffn_out", "resid_post"]
    fig1 = plotting.site_norms_figure(
        {s: result.site_norms[s] for s in sites}, loc.me_layer, result.model
    )
    what = (
        "ME layer"
        if loc.me_layer is not None
        else "layer with the largest norm ratio (no ME layer)"
    )
    heat = plotting.token_dim_heatmap(
        result.heatmap_values,
        result.heatmap_tokens,
        f"|layer output| of prompt 0 at the {what} {result.heatmap_layer} "
        f"(1-based {result.heatmap_layer + 1})",
    )
    ratio = plotting.layer_lines(
        {
            "max token / mean of others (layer output)": loc.top_ratio,
            "max |a| / median |a| (layer output)": loc.max_over_median,
        },
        "Massive-activation ratios per layer (median over prompts)",
        "ratio",
        loc.me_layer,
        log_y=True,
    )
    return {"norms_by_site": fig1, "me_layer_tokens_by_dim": heat, "ratios": ratio}


def summary(result: Result) -> str:
    loc = result.location
    lines = [
        f"model: {result.model}   bos: {result.bos} (BOS prepended: {result.bos_prepended})   "
        f"prompts: {result.n_prompts}",
    ]
    if loc.me_layer is None:
        lines.append("ME layer: none found (no layer output meets the massive criterion)")
    else:
        ev = loc.me_event
        lines.append(
            f"ME layer: {loc.me_layer} (0-based) = {loc.me_layer + 1} (1-based); created by the "
            f"{ev.site}; jump x{ev.jump:.3g}; dims {loc.massive_dims[:8]}; positions "
            f"{sorted({p for ps in loc.massive_positions for p in ps})}"
        )
    rows = [
        (
            e.layer,
            e.layer_1based,
            e.last_layer,
            "yes" if e.persists_to_end else "no",
            e.site,
            e.jump,
            str(e.dims[:4]),
        )
        for e in loc.events
    ]
    if rows:
        lines.append("")
        lines.append(
            fmt_table(["start", "start(1b)", "last", "to end", "site", "jump", "dims"], rows)
        )
    return "\n".join(lines)


def verdicts(result: Result) -> list[dict[str, Any]]:
    """Claim 1 of the paper (sudden emergence at one layer, by the FFN, carried by the residual)."""
    loc = result.location
    ev = loc.me_event
    if ev is None:
        return [
            {
                "claim": "Massive activations appear suddenly at one layer (the ME layer)",
                "measured": "no layer output meets the massive criterion",
                "holds": False,
            }
        ]
    n = len(loc.top_ratio)
    carried = ev.last_layer - ev.layer + 1
    return [
        {
            "claim": "Massive activations appear suddenly at one layer (the ME layer)",
            "measured": f"ME layer {ev.layer} (1-based {ev.layer + 1}): norm ratio jumps x{ev.jump:.3g} "
            f"in one layer; {len(loc.events)} emergence event(s)",
            "holds": ev.jump >= 10,
        },
        {
            "claim": "The ME layer's FFN (not its attention) creates the massive activation",
            "measured": f"log-ratio gain FFN {ev.ffn_log_gain:.3g} vs attention {ev.attn_log_gain:.3g}",
            "holds": ev.site == "ffn",
        },
        {
            "claim": "The residual stream then carries it to the last layer",
            "measured": f"massive at {carried} of the {n - ev.layer} layers from the ME layer on "
            f"(to layer {ev.last_layer}); last-layer ratio {loc.top_ratio[-1]:.3g}",
            "holds": ev.persists_to_end,
        },
    ]


def main(argv: Sequence[str] | None = None) -> int:
    return cli_main(NAME, Config, run, figures, summary, argv, description=__doc__)


if __name__ == "__main__":
    raise SystemExit(main())
