"""The paper's table as one command: the ME-layer scan over a list of models, one table, one figure.

Runs the ME-layer scan of :mod:`me_interp.experiments.me_layer` (same prompts, criterion and claims)
on each model in turn, freeing each (``del``, ``gc.collect()``, ``torch.cuda.empty_cache()``) before
loading the next, so a GPU holds one model at a time. Writes ``<out>/survey/<run_id>/`` with
``survey.md`` (the table), ``result.json`` (one row per model with the per-layer ratios and the four
``me_layer`` claims), ``config.json``, ``env.json`` (versions, and each model's loading choices) and
one figure, ``ratios_by_model`` (per model, the massive token's norm over the others' mean per layer).

The table's columns (:func:`table`) come from each model's scan (:class:`Row`), with the verdict of
``me_layer.sudden_birth`` and the super weight (:func:`me_interp.probes.down_proj.survey`:
detection only, on 16 prompts cut to 16 tokens). A model that cannot be loaded (no hub, a missing
package, an unsupported architecture) or whose scan crashes gives a row with the error, and the
survey goes on.

Exit status: 0 when every model was scanned (also when some have no massive activation), 1 when a
model could not be loaded or scanned (its row says why), 2 on bad input (a bad flag or prompt file).

    python -m me_interp.experiments.survey                          # bundled + gemma-3-270m
    python -m me_interp.experiments.survey --models bundled gemma-3-270m synthetic:planted
    python -m me_interp.experiments.survey --device cuda --models Qwen/Qwen3-4B-Instruct-2507 \\
        Qwen/Qwen3-8B meta-llama/Llama-3.1-8B mistralai/Mistral-7B-v0.1       # docs/me_layer.md
    python -m me_interp.experiments.survey --backend nnsight --remote --models \\
        meta-llama/Llama-3.1-8B meta-llama/Llama-3.1-70B meta-llama/Llama-3.1-405B  # docs/remote.md
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import traceback
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
import torch

from me_interp import claims, io, plotting, terminal
from me_interp.experiments import me_layer
from me_interp.experiments.me_layer import Result as Scan
from me_interp.loading import load_model
from me_interp.loading.devices import resolve_device
from me_interp.loading.errors import ModelLoadError
from me_interp.loading.loaded import LoadedModel
from me_interp.probes import down_proj
from me_interp.probes.down_proj import SuperWeightCell
from me_interp.probes.massive import Criterion, Event
from me_interp.probes.measurement import short_batch
from me_interp.study.cli import BAD_INPUT, build_parser, config_from_args, is_bad_input
from me_interp.study.config import checked, placement_kwargs
from me_interp.study.experiment import apply_threads, seed_everything
from me_interp.study.result import RunHeader

NAME = "survey"
TABLE_FILE = "survey.md"
OK, LOAD_FAILED, FAILED = "ok", "load failed", "scan failed"
ERROR_CHARS = 240
"""An error is cut to this many characters in the table (``result.json`` holds all of it)."""


@dataclass(frozen=True)
class Config(me_layer.Config):
    """Survey settings: the ME-layer scan's (criterion, thresholds, prompts, BOS, dtype, device) for
    every model.

    Attributes:
        models: the models to scan, in order: bundled, a packaged short name (gemma-3-270m), an HF
            name, a local directory, or synthetic:planted / synthetic:twin / ...
    """

    models: tuple[str, ...] = checked(("bundled", "gemma-3-270m"), nonempty=True, unique=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.model is not None:
            raise ValueError(
                f"the survey scans --models (a list), not --model; got --model {self.model!r}"
            )

    def scan_config(self, model: str) -> me_layer.Config:
        """The ME-layer config of one model of the survey."""
        fields = me_layer.Config.__dataclass_fields__
        return me_layer.Config(**{**{k: getattr(self, k) for k in fields}, "model": model})


@dataclass(frozen=True)
class Row:
    """One model of the survey (``status`` ok, or the error that stopped it; 0-based layers).

    Attributes:
        scan: the ME-layer scan (:class:`me_interp.experiments.me_layer.Result`), whose claims the
            row states; the other columns are read from it.
        positions: the positions massive in at least ``min_prompt_fraction`` of the prompts, with
            ``position_share`` (the fraction of prompts) and ``other_positions`` (how many others).
        arch: the model's architecture description (written to ``env.json``, not ``result.json``).
    """

    model: str
    status: str
    error: str | None = None
    traceback: str | None = None
    name: str | None = None
    architecture: str | None = None
    n_layers: int | None = None
    d_model: int | None = None
    me_layer: int | None = None
    positions: list[int] = field(default_factory=list)
    position_share: list[float] = field(default_factory=list)
    other_positions: int = 0
    scan: Scan | None = None
    super_weight: SuperWeightCell | None = None
    arch: Any = field(default=None, compare=False, metadata={io.TRANSIENT: True})

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def event(self) -> Event | None:
        return None if self.scan is None else self.scan.location.me_event

    @property
    def ratio(self) -> list[float]:
        return [] if self.scan is None else list(self.scan.location.site_ratios["resid_post"])

    @property
    def peak_layer(self) -> int | None:
        r = self.ratio
        return max(range(len(r)), key=lambda i: r[i]) if r else None

    @property
    def dims(self) -> list[int]:
        return [] if self.event is None else list(self.scan.location.massive_dims)

    @property
    def claims(self) -> list[claims.Claim]:
        return [] if self.scan is None else claims.judge(me_layer.SPECS, self.scan)

    def verdict(self, claim_id: str) -> str | None:
        return next((c.verdict for c in self.claims if c.id == claim_id), None)

    def bos_rule(self) -> str:
        if self.scan is None:
            return ""
        prepended = "BOS prepended" if self.scan.bos_prepended else "no BOS"
        return f"{self.scan.header.bos}: {prepended}"


@dataclass(frozen=True)
class Result:
    """Every row, in the order of ``Config.models`` (``header.model``: the models, comma-separated)."""

    header: RunHeader
    criterion: Criterion
    rows: list[Row]

    @property
    def failed(self) -> list[Row]:
        return [r for r in self.rows if not r.ok]


def _row(spec: str, model: LoadedModel, res: Scan, min_fraction: float) -> Row:
    """The survey row of one scanned model."""
    loc, info = res.location, model.info()
    row = Row(
        spec,
        OK,
        name=model.name,
        architecture=info.get("architecture"),
        n_layers=model.n_layers,
        d_model=model.d_model,
        scan=res,
        arch=info.get("arch"),
    )
    if loc.me_event is None:
        return row
    counts = Counter(p for ps in loc.massive_positions for p in ps)
    n = len(loc.massive_positions)
    common = sorted(p for p, c in counts.items() if c >= min_fraction * n)
    return dataclasses.replace(
        row,
        me_layer=loc.me_event.layer,
        positions=common,
        position_share=[counts[p] / n for p in common],
        other_positions=len(counts) - len(common),
    )


def _failed(spec: str, status: str, e: Exception, model: LoadedModel | None = None) -> Row:
    """The row of a model whose load or scan raised ``e`` (inside its ``except``)."""
    name, arch = (None, None) if model is None else (model.name, type(model.hf).__name__)
    return Row(spec, status, f"{type(e).__name__}: {e}", traceback.format_exc(), name, arch)


def free_memory() -> None:
    """Collect garbage and return cached CUDA memory (after a model was dropped)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run(
    cfg: Config,
    models: Mapping[str, LoadedModel] | None = None,
    *,
    load: Callable[..., LoadedModel] = load_model,
    progress: Callable[[str], None] | None = None,
) -> Result:
    """Scan every model of ``cfg.models`` in turn. No printing, no files.

    ``models``: already loaded models by their entry in ``cfg.models`` (used as they are, not freed:
    the caller owns them); the others are loaded with ``load`` (tests pass a recording one) and
    freed after their scan. ``progress``: called with one line per model. A model that cannot be
    loaded or whose scan raises gives a row with the error instead of stopping the survey.
    """
    given = dict(models or {})
    resolve_device(cfg.device)  # a device this machine lacks is bad input, not a row per model
    nnsight_backend = cfg.backend == "nnsight"
    if nnsight_backend:
        from me_interp.backends import nnsight

        if cfg.remote:
            nnsight.check_remote()  # no key or no network: bad input, not a row per model
        if load is load_model:
            load = partial(nnsight.load, remote=cfg.remote)
    prompts = cfg.load_prompts()
    rows = []
    for i, spec in enumerate(cfg.models):
        if progress:
            progress(f"survey [{i + 1}/{len(cfg.models)}] {spec}")
        model = given.get(spec)
        owned = model is None
        try:
            if model is None:
                where = placement_kwargs(cfg)  # --device-map/--max-memory/--offload-folder
                model = load(spec, bos=cfg.bos, dtype=cfg.dtype, device=cfg.device, **where)
        except ModelLoadError as e:  # no hub, a missing package, an unsupported architecture
            rows.append(Row(spec, LOAD_FAILED, error=f"{type(e).__name__}: {e}"))
            continue
        except Exception as e:  # e.g. out of memory while loading: the other models still run
            rows.append(_failed(spec, LOAD_FAILED, e))
            free_memory()
            continue
        try:
            res = me_layer.run(cfg.scan_config(spec), model)
            rows.append(_row(spec, model, res, cfg.min_prompt_fraction))
            if nnsight_backend:  # super weights need TL hooks on W_down: not measured (empty cell)
                continue
            try:  # detection only (two short forwards); its failure must not lose the scan
                cell = down_proj.survey(model, short_batch(model, prompts, 16, 16), cfg.detection())
            except Exception as e:
                cell = SuperWeightCell(error=f"{type(e).__name__}: {e}")
            rows[-1] = dataclasses.replace(rows[-1], super_weight=cell)
        except Exception as e:  # one model's crash (e.g. out of memory) must not lose the others
            rows.append(_failed(spec, FAILED, e, model))
        finally:
            res = None
            if owned:
                model = None
                free_memory()
    header = RunHeader(
        ", ".join(cfg.models), cfg.bos, cfg.prompts or "built-in", len(prompts), cfg.seed
    )
    return Result(header, cfg.detection(), rows)


def _fmt(v: float | None) -> str:
    return "" if v is None else f"{v:.3g}"


def table(result: Result) -> str:
    """The survey as a markdown table (one row per model)."""
    header = [
        "model",
        "architecture",
        "layers",
        "ME layer (0-based)",
        "ME layer (1-based)",
        "site",
        "jump",
        "dims",
        "positions",
        "event ends at",
        "persists to last layer",
        "BOS rule",
        "peak ratio (layer)",
        "sudden_birth",
        "super weight (layer [row, col])",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for r in result.rows:
        if not r.ok:
            err = " ".join((r.error or "").split()).replace("|", "\\|")
            err = err if len(err) <= ERROR_CHARS else err[: ERROR_CHARS - 1] + "…"
            cells = [r.model, r.architecture or "", "", f"{r.status}: {err}"] + [""] * 11
        else:
            ev, peak = r.event, r.peak_layer
            pos = ", ".join(map(str, r.positions)) + (
                f" (+{r.other_positions} others in fewer prompts)" if r.other_positions else ""
            )
            cells = [r.model, r.architecture or "", str(r.n_layers)]
            cells += (
                ["none", "none", *[""] * 6]
                if ev is None
                else [
                    str(ev.layer),
                    str(ev.layer_1based),
                    ev.site,
                    f"×{ev.jump:.3g}",
                    ", ".join(map(str, r.dims[:4])),
                    pos,
                    str(ev.last_layer),
                    "yes" if ev.persists_to_end else "no",
                ]
            )
            cells += [
                r.bos_rule(),
                f"{_fmt(None if peak is None else r.ratio[peak])} ({peak})",
                r.verdict("me_layer.sudden_birth") or "",
                "" if r.super_weight is None else r.super_weight.text(),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def figures(result: Result) -> dict[str, go.Figure]:
    """``ratios_by_model``: one subplot per scanned model (:func:`me_interp.plotting.layer_grid`):
    the massive token's layer-output norm over the others' mean (median over prompts), ME layer
    dashed."""
    rows = [r for r in result.rows if r.ok]
    if not rows:
        return {}
    title = (
        "Massive token's norm over the mean of the other tokens, per layer (median over "
        f"{result.header.n_prompts} prompts)<br><sup>layer output; dashed line: ME layer</sup>"
    )
    series = {r.model: (r.ratio, r.me_layer) for r in rows}
    return {"ratios_by_model": plotting.layer_grid(series, title, "massive / others")}


def summary(result: Result) -> str:
    return table(result)


def write(cfg: Config, result: Result) -> Path:
    """Write ``<cfg.out>/survey/<run_id>/`` (the table, figures, config, env; ``result.json`` last)."""
    run_dir = io.new_run_dir(cfg.out, NAME)
    io.write_json(run_dir / io.CONFIG_FILE, cfg)
    keys = ("model", "name", "architecture", "arch", "status")
    models = [{k: getattr(r, k) for k in keys} for r in result.rows]
    env = io.environment(None, models=models, dtype=cfg.dtype, device=cfg.device, bos=cfg.bos)
    io.write_json(run_dir / io.ENV_FILE, env)
    io.write_figures(run_dir, figures(result), out_root=Path(cfg.out))
    io.atomic_write_text(run_dir / TABLE_FILE, table(result) + "\n")
    body = io.to_jsonable(result)  # each row with its claims (read back by io.from_jsonable)
    for row, r in zip(body["rows"], result.rows, strict=True):
        row["claims"] = io.to_jsonable(r.claims)
    io.write_json(run_dir / io.RESULT_FILE, body)
    return run_dir


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(Config, f"python -m me_interp.experiments.{NAME}", __doc__)
    for action in parser._actions:  # the common --model is refused here (--models): not offered
        if "--model" in action.option_strings:
            action.help = argparse.SUPPRESS
    terminal.add_output_flags(parser)
    args = parser.parse_args(argv)
    output = terminal.output_from_args(args)
    try:
        cfg = config_from_args(Config, args)
        apply_threads(cfg)
        seed_everything(cfg.seed)
        result = run(cfg, progress=terminal.note)
        run_dir = write(cfg, result)
    except BAD_INPUT as e:
        if not is_bad_input(e):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not output.quiet:
        output.text(summary(result))
    for r in result.rows:
        output.text(f"{r.model}:" + (f" {r.status}: {r.error}" if not r.ok else ""))
        output.claims(f"{NAME}:{r.model}", r.claims or [])
    output.text(f"results: {run_dir}")
    return 1 if result.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
