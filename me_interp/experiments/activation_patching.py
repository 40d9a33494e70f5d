"""Activation patching of the massive activation: which (site, layer, position) carries it downstream?

Clean run: the prompts (first ``--max-tokens`` tokens of the first ``--max-prompts`` prompts long
enough). Corrupt run, chosen by ``--corruption``:

* ``first_token`` — token 0 replaced by token 1 (the prompt without its first token, the next token
  doubled to keep the length). On a model whose sink token is BOS (the planted model) this removes
  the massive activation;
* ``remove_ffn`` — same tokens, but the ME layer's FFN output of the massive token is set to the other
  tokens' mean FFN output (``interventions.causal.remove_massive``, prompt-mean values, so the hook is
  row-wise). On SmolLM2 the massive activation appears at position 0 whatever the first token is, so
  this is the corruption that removes it;
* ``auto`` — ``first_token`` when it brings the massive token's ME-layer norm over the median norm
  of the other tokens under ``--removal-fraction`` of the clean value (measured), else
  ``remove_ffn``. (On SmolLM2 doubling the first token makes position 1 massive as well.)

For each site (``resid_pre``, ``attn_out``, ``mlp_out``, ``ffn_in`` = the pre-FFN RMSNorm output) every
``(layer, position)`` is patched from the clean run, batched (``me_interp.patching.patch_sweep``), and
two metrics are read: the massive token's norm ratio at the output of ``--metric-layer`` (default: the
last layer) and its attention sink (mean attention to it over the layers after the ME layer), both
normalised so that clean = 1 and corrupt = 0.

    python -m me_interp.experiments.activation_patching
    python -m me_interp.experiments.activation_patching --model synthetic:planted --prompts p.txt
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from me_interp import names
from me_interp.experiments.common import CommonConfig, check_choices, cli_main, fmt_table, model_for
from me_interp.interventions import causal
from me_interp.models import Batch, LoadedModel
from me_interp.patching import PATCH_SITES, NormRatio, SinkMass, SweepResult, patch_sweep

NAME = "activation_patching"
CORRUPTIONS = ("auto", "first_token", "remove_ffn")
CLAIM = (
    "The massive activation is written by the ME layer's FFN at the massive token and carried "
    "downstream by the residual stream: patching that FFN output from the clean run restores it"
)


@dataclass(frozen=True)
class Config(CommonConfig):
    """Activation-patching settings.

    Attributes:
        sites: sites to patch, each swept over every (layer, position): ``resid_pre``, ``attn_in``,
            ``attn_out``, ``ffn_in`` (pre-FFN RMSNorm output), ``ffn_out``, ``resid_mid``,
            ``resid_post``, ``mlp_out`` (= the FFN output).
        corruption: ``first_token`` (token 0 replaced by token 1), ``remove_ffn`` (the ME layer's FFN
            output of the massive token set to the other tokens' mean) or ``auto`` (``first_token``
            when it removes the massive activation, else ``remove_ffn``).
        max_tokens: clean prompts are cut to their first ``max_tokens`` tokens; only prompts at least
            that long are used (when none is, all are cut to the shortest prompt's length; >= 2).
        max_prompts: how many of those prompts to use (>= 1).
        metric_layer: layer (0-based) whose output gives the norm-ratio metric; ``None`` = the last
            layer.
        layer: the ME layer (0-based); ``None`` = detected on the prompts.
        batch_size: patched forwards per batch of the sweep.
        removal_fraction: ``auto`` picks ``first_token`` when it brings the massive token's ME-layer
            norm / median of the others to at most this fraction of the clean value, in (0, 1).
        restore_threshold: the verdict holds when patching the ME layer's FFN output restores at least
            this normalised metric (clean = 1, corrupt = 0), in (0, 1].
    """

    sites: tuple[str, ...] = ("resid_pre", "attn_out", "mlp_out", "ffn_in")
    corruption: Literal["auto", "first_token", "remove_ffn"] = "auto"
    max_tokens: int = 8
    max_prompts: int = 4
    metric_layer: int | None = None
    layer: int | None = None
    batch_size: int = 64
    removal_fraction: float = 0.1
    restore_threshold: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choices(self.sites, PATCH_SITES, "site")
        if self.corruption not in CORRUPTIONS:
            raise ValueError(f"corruption must be one of {CORRUPTIONS}, got {self.corruption!r}")
        if self.max_tokens < 2:
            raise ValueError("max_tokens must be >= 2")
        if self.max_prompts < 1:
            raise ValueError("max_prompts must be >= 1")
        if self.batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        for f in ("metric_layer", "layer"):
            if getattr(self, f) is not None and getattr(self, f) < 0:
                raise ValueError(f"{f} must be >= 0")
        if not 0 < self.removal_fraction < 1 or not 0 < self.restore_threshold <= 1:
            raise ValueError("removal_fraction must be in (0, 1) and restore_threshold in (0, 1]")


def clean_batch(
    model: LoadedModel, prompts: Sequence[str], max_tokens: int, max_prompts: int
) -> Batch:
    """The first ``max_tokens`` tokens of the first ``max_prompts`` prompts that have that many
    (all prompts truncated to the shortest length when none has), unpadded."""
    rows = [model.tokenize([p]).tokens[0].tolist() for p in prompts]
    long = [r for r in rows if len(r) >= max_tokens]
    if long:
        rows = [r[:max_tokens] for r in long[:max_prompts]]
    else:
        n = min(len(r) for r in rows)
        if n < 2:
            raise ValueError("patching needs prompts of at least 2 tokens")
        rows = [r[:n] for r in rows[:max_prompts]]
    return model.batch_from_ids(rows)


def first_token_corrupt(model: LoadedModel, clean: Batch) -> Batch:
    """Token 0 replaced by token 1 of each prompt (same length)."""
    t = clean.tokens.clone()
    t[:, 0] = t[:, 1]
    return Batch(t, clean.attention_mask.clone(), None)


def median_ratio(model: LoadedModel, batch: Batch, layer: int, position: int) -> float:
    """Prompt mean of ``‖h_p‖ / median_{t≠p} ‖h_t‖`` at the output of ``layer``.

    The median, not the mean, of the others: a corruption that makes a *second* token massive
    (SmolLM2 does this when token 0 is doubled) must not count as removing the massive activation.
    """
    name = names.resid_post(layer)
    n = causal.capture(model, batch, [name])[name].float().norm(dim=-1).cpu()  # [batch pos]
    keep = batch.attention_mask.bool().cpu().clone()
    keep[:, position] = False
    others = n.masked_fill(~keep, float("nan")).nanmedian(-1).values
    return float((n[:, position] / others).mean())


@dataclass
class Result:
    model: str
    bos: str
    site: causal.MassiveSite
    corruption: str
    corruption_note: str
    metric_layer: int
    restore_threshold: float
    sweeps: dict[str, SweepResult]
    tokens: list[str]

    def _me_cell(self, metric: str) -> float | None:
        sw = self.sweeps.get("mlp_out") or self.sweeps.get("ffn_out")
        if sw is None or self.site.layer not in sw.layers or self.site.position not in sw.positions:
            return None
        return sw.cell(metric, self.site.layer, self.site.position)

    def holds(self) -> bool | None:
        v = self._me_cell("norm_ratio")
        return None if v is None or v != v else bool(v >= self.restore_threshold)

    def to_dict(self) -> dict[str, Any]:
        any_sw = next(iter(self.sweeps.values()))
        sw_me = self.sweeps.get("mlp_out") or self.sweeps.get("ffn_out")
        intervened = {"patch": f"mlp_out at layer {self.site.layer}, position {self.site.position}"}
        if sw_me is not None and self._me_cell("norm_ratio") is not None:
            for k in sw_me.values:
                intervened[k] = sw_me.cell(k, self.site.layer, self.site.position, normalise=False)
                intervened[f"{k}_normalized"] = sw_me.cell(k, self.site.layer, self.site.position)
        return {
            "claim": CLAIM,
            "baseline": {
                "corrupt": {k: float(v.mean()) for k, v in any_sw.corrupt.items()},
                "clean": {k: float(v.mean()) for k, v in any_sw.clean.items()},
            },
            "intervened": intervened,
            "verdict": {
                "holds": self.holds(),
                "normalized_norm_ratio": self._me_cell("norm_ratio"),
                "rule": f"normalised norm ratio >= {self.restore_threshold:g}",
            },
            "model": self.model,
            "bos": self.bos,
            "massive_site": self.site.to_dict(),
            "corruption": self.corruption,
            "corruption_note": self.corruption_note,
            "metric_layer": self.metric_layer,
            "tokens_prompt0": self.tokens,
            "sweeps": {s: sw.to_dict() for s, sw in self.sweeps.items()},
        }


def run(cfg: Config, model: LoadedModel | None = None) -> Result:
    """Build the clean/corrupt pair and sweep every site. No printing, no files."""
    model = model_for(cfg, model)
    prompts = cfg.load_prompts()
    full = model.tokenize(prompts)
    site = causal.locate_massive(model, full, cfg.layer, None)
    clean = clean_batch(model, prompts, cfg.max_tokens, cfg.max_prompts)
    T = clean.tokens.shape[1]
    p = site.position
    if not p < T - 1:
        raise ValueError(f"the massive position {p} is not inside the first {T - 1} tokens")
    last = model.n_layers - 1
    metric_layer = last if cfg.metric_layer is None else model.check_layer(cfg.metric_layer)
    metrics: dict[str, Any] = {"norm_ratio": NormRatio(metric_layer, p)}
    if site.layer < last:
        metrics["sink"] = SinkMass(tuple(range(site.layer + 1, model.n_layers)), p)

    clean_me = median_ratio(model, clean, site.layer, p)
    corruption, corrupt_hooks, note = cfg.corruption, [], ""
    if corruption in ("auto", "first_token"):
        corrupt = first_token_corrupt(model, clean)
        ft_me = median_ratio(model, corrupt, site.layer, p)
        note = (
            f"first-token replacement: ME-layer norm / median of others {clean_me:.4g} (clean) "
            f"-> {ft_me:.4g}"
        )
        if corruption == "auto":
            corruption = "first_token" if ft_me <= cfg.removal_fraction * clean_me else "remove_ffn"
            note += f"; auto chose {corruption}"
    if corruption == "remove_ffn":
        corrupt = clean
        corrupt_hooks = causal.remove_massive(
            model, clean, site.layer, [p], None, site="ffn_out", per_prompt=False
        )
    sweeps = {
        s: patch_sweep(
            model,
            clean,
            corrupt,
            s,
            metrics,
            batch_size=cfg.batch_size,
            corrupt_hooks=corrupt_hooks,
        )
        for s in cfg.sites
    }
    tokens = [model.tokenizer.decode([int(t)]) for t in clean.tokens[0]]
    return Result(
        model=model.name,
        bos=model.bos,
        site=site,
        corruption=corruption,
        corruption_note=note,
        metric_layer=metric_layer,
        restore_threshold=cfg.restore_threshold,
        sweeps=sweeps,
        tokens=tokens,
    )


def verdicts(result: Result) -> list[dict]:
    s = result.site
    out = []
    v = result._me_cell("norm_ratio")
    out.append(
        {
            "claim": CLAIM,
            "measured": f"corruption {result.corruption}; patching mlp_out at layer {s.layer}, position "
            f"{s.position}: normalised norm ratio at layer {result.metric_layer} = "
            + ("n/a" if v is None else f"{v:.3f}"),
            "holds": result.holds(),
        }
    )
    sink = result._me_cell("sink")
    if sink is not None:
        out.append(
            {
                "claim": "The downstream attention sink follows the massive activation: patching the "
                "ME-layer FFN output at the massive token restores the sink",
                "measured": f"normalised sink = {sink:.3f}",
                "holds": None if sink != sink else bool(sink >= result.restore_threshold),
            }
        )
    rp = result.sweeps.get("resid_pre")
    later = [x for x in (rp.layers if rp else []) if x > s.layer]
    if rp is not None and later and s.position in rp.positions:
        vals = [rp.cell("norm_ratio", x, s.position) for x in later]
        others = [
            float(sw.normalized("norm_ratio")[sw.layers.index(x)].abs().max())
            for name, sw in result.sweeps.items()
            if name in ("attn_out", "mlp_out", "ffn_out")
            for x in sw.layers
            if x > s.layer
        ]
        mean_rp = sum(vals) / len(vals)
        max_other = max(others) if others else float("nan")
        out.append(
            {
                "claim": "After the ME layer the massive activation is carried by the residual stream "
                "at its token, not rewritten by later sub-layers",
                "measured": f"mean normalised ratio of resid_pre patches at position {s.position}, "
                f"layers > {s.layer}: {mean_rp:.3f}; largest |normalised| attn_out/mlp_out patch "
                f"after the ME layer: {max_other:.3f}",
                "holds": bool(
                    mean_rp >= result.restore_threshold
                    and not max_other >= result.restore_threshold
                ),
            }
        )
    return out


def figures(result: Result) -> dict[str, Any]:
    figs = {}
    labels = [f"{i}: {t!r}" for i, t in enumerate(result.tokens)]
    metric_names = next(iter(result.sweeps.values())).metric_names
    for metric in metric_names:
        sites = list(result.sweeps)
        fig = make_subplots(rows=1, cols=len(sites), subplot_titles=sites, shared_yaxes=True)
        for i, s in enumerate(sites):
            sw = result.sweeps[s]
            fig.add_trace(
                go.Heatmap(
                    z=sw.normalized(metric).T.tolist(),
                    x=sw.layers,
                    y=[labels[p] for p in sw.positions],
                    zmin=-1,
                    zmax=1,
                    colorscale="RdBu",
                    reversescale=True,
                    showscale=i == 0,
                    hovertemplate="layer %{x}<br>position %{y}<br>normalised %{z:.3f}<extra>"
                    + s
                    + "</extra>",
                ),
                row=1,
                col=i + 1,
            )
            fig.update_xaxes(title_text="layer (0-based)", row=1, col=i + 1)
        fig.update_yaxes(autorange="reversed")
        fig.update_layout(
            title=f"Activation patching, metric {metric} (clean = 1, corrupt = 0) — {result.model}"
            f"<br><sup>corruption: {result.corruption}; ME layer {result.site.layer}</sup>",
            template="plotly_white",
            height=max(350, 30 * len(labels) + 200),
        )
        figs[f"patching_{metric}"] = fig
    return figs


def summary(result: Result) -> str:
    s = result.site
    rows = []
    for name, sw in result.sweeps.items():
        for metric in sw.metric_names:
            grid = sw.normalized(metric)
            flat = int(grid.nan_to_num(-1e9).argmax())
            li, pi = divmod(flat, grid.shape[1])
            rows.append(
                (name, metric, sw.layers[li], sw.positions[pi], float(grid[li, pi]), sw.n_forwards)
            )
    return "\n".join(
        [
            f"model: {result.model}   ME layer {s.layer} (1-based {s.layer + 1}), position {s.position}; "
            f"corruption {result.corruption} ({result.corruption_note})",
            f"verdict (mlp_out at the ME layer restores the massive activation): {result.holds()}",
            fmt_table(["site", "metric", "best layer", "best pos", "normalised", "forwards"], rows),
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    return cli_main(NAME, Config, run, figures, summary, argv, description=__doc__)


if __name__ == "__main__":
    raise SystemExit(main())
