"""Benchmark: what the ME-layer scan, one batched patching sweep and the battery cost as the prompts,
the tokens, the layers and the width grow (``docs/scaling.md``).

Each curve varies one quantity and holds the others; each point is measured ``--repeats`` times
(at least twice) and the minimum is kept (the machine may be shared). Per point: wall time, the
process's peak resident set during the call (``me_interp.usage.track``: the kernel's high-water mark
is reset before each call) and the RSS just before it, so ``added`` = peak − before is the memory the
call itself needed; on a GPU also ``torch.cuda.max_memory_allocated`` (and the allocation before).

* **scan**: ``scan_norms`` at the 7 sites + ``locate_me_layer`` (what ``me_layer`` runs), on Llama
  models built from a ``LlamaConfig`` with random weights (seeded), random token ids, no padding;
* **patching**: one ``me_interp.patching.patch_sweep`` as the ``activation_patching`` experiment runs
  it with its first-token corruption: ``resid_pre`` at every layer and positions 0 and 1, metrics
  ``NormRatio`` (last layer) and ``SinkMass`` (every later layer's attention patterns). The metrics
  need no massive activation, so a random-weight model does the same work as a real one;
* **battery**: ``battery.run_battery`` (figures off) on the planted model of
  ``me_interp.synthetic.planted`` (d_model 32; the battery needs a massive activation to run its
  experiments to the end), with its layers, prompts and prompt length varied.

For every curve the growth exponent is the least-squares slope of log(cost) on log(x). The scan's
memory above the weights as the layers grow is fitted as a straight line (MiB per layer) and compared
with the weights' MiB per layer.

    python benchmarks/bench_scaling.py                       # the full run (docs/scaling.md)
    python benchmarks/bench_scaling.py --quick --out /tmp/s  # tiny smoke run (under a minute)
    python benchmarks/bench_scaling.py --point scan --d-model 4096 --n-layers 32 --d-mlp 14336 \\
        --heads 32 --kv-heads 8 --vocab 128256 --prompts 8 --tokens 512 --device cuda \\
        --dtype bfloat16 --json scan_8b.json                # one point (Llama-3.1-8B shape)
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import itertools
import json
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _scaling_output import BENCHES, svg, tables  # noqa: E402
from _sections import replace_section  # noqa: E402

DOC_SECTION = "scaling-tables"
JSON_FILE, SVG_FILE, TABLES_FILE = "scaling.json", "scaling.svg", "scaling_tables.md"


# ---- models -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """A Llama shape: ``d_mlp`` defaults to 8/3·d rounded up to 64, heads of 64 dims (16 below
    d_model 256), as many key-value heads as heads."""

    d_model: int
    n_layers: int
    d_mlp: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    vocab: int = 32000

    def config(self):
        from transformers import LlamaConfig

        hd = 64 if self.d_model >= 256 else 16
        heads = self.n_heads or self.d_model // hd
        step = 64 if self.d_model >= 256 else 16
        d_mlp = self.d_mlp or -(-(8 * self.d_model) // 3 // step) * step
        cfg = LlamaConfig(
            vocab_size=self.vocab,
            hidden_size=self.d_model,
            intermediate_size=d_mlp,
            num_hidden_layers=self.n_layers,
            num_attention_heads=heads,
            num_key_value_heads=self.n_kv_heads or heads,
            head_dim=self.d_model // heads,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=3,
        )
        cfg._attn_implementation = "eager"
        return cfg


def build(shape: Shape, device: str = "cpu", dtype: str = "float32"):
    """A random-weight (seeded) Llama of ``shape``, built on ``device`` in ``dtype``, loaded."""
    from transformers import LlamaForCausalLM

    from me_interp import load_model, synthetic

    torch.manual_seed(0)
    with torch.device(device):
        hf = LlamaForCausalLM._from_config(shape.config(), dtype=getattr(torch, dtype)).eval()
    return load_model(hf, tokenizer=synthetic.word_tokenizer(), device=device, dtype=dtype)


def weight_mib(model) -> float:
    return sum(p.numel() * p.element_size() for p in model.hf.parameters()) / 2**20


def n_params(model) -> int:
    return sum(p.numel() for p in model.hf.parameters())


def random_batch(model, prompts: int, tokens: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, model.hf.config.vocab_size, (prompts, tokens), generator=g)
    return model.batch_from_ids(ids.tolist())


# ---- the work ---------------------------------------------------------------------------------


def scan_work(model, prompts: int, tokens: int) -> Callable[[], None]:
    from me_interp import names
    from me_interp.probes import locate_me_layer, scan_norms

    batch = random_batch(model, prompts, tokens)
    return lambda: locate_me_layer(scan_norms(model, batch, names.SITES))


def patching_work(model, prompts: int, tokens: int) -> Callable[[], None]:
    from me_interp.models import Batch
    from me_interp.patching import NormRatio, SinkMass, patch_sweep

    clean = random_batch(model, prompts, tokens)
    t = clean.tokens.clone()
    t[:, 0] = t[:, 1]  # activation_patching.first_token_corrupt
    corrupt = Batch(t, clean.attention_mask.clone(), None)
    last = model.n_layers - 1
    metrics = {
        "norm_ratio": NormRatio(last, 0),
        "sink": SinkMass(tuple(range(1, model.n_layers)), 0),
    }
    return lambda: patch_sweep(
        model, clean, corrupt, "resid_pre", metrics, positions=[0, 1], progress=False
    )


def battery_work(n_layers: int, prompts: int, length: int, experiments, root: Path):
    """The battery on a planted model of ``n_layers`` (massive activation at layer 2), on
    ``prompts`` planted prompts of ``length`` words; each call runs it afresh in a new directory."""
    from me_interp import battery, falsifiability, load_model, report, synthetic
    from me_interp.study import CommonConfig

    hf, tok, _ = synthetic.planted("llama", layer=2, n_layers=n_layers)
    model = load_model(hf, tokenizer=tok, device="cpu", dtype="float32")
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"prompts_{prompts}_{length}.txt"
    path.write_text("\n".join(synthetic.planted_prompts(prompts, length)) + "\n", encoding="utf-8")
    overrides = falsifiability.overrides("synthetic:planted", root)
    runs = itertools.count()

    def run() -> None:
        out = root / f"out_{n_layers}_{prompts}_{length}_{next(runs)}"
        state = battery.run_battery(
            CommonConfig(model="synthetic:planted", prompts=str(path), out=str(out)),
            experiments=experiments,
            model=model,
            overrides=overrides,
            figures=False,
            fresh=True,
        )
        failed = [n for n, e in state["experiments"].items() if e["status"] not in report.FINISHED]
        if failed:
            errors = "; ".join(f"{n}: {state['experiments'][n].get('error')}" for n in failed)
            raise RuntimeError(f"battery experiments failed: {errors}")

    return model, run


# ---- measuring --------------------------------------------------------------------------------


def _rss_mib() -> float | None:
    from me_interp.usage import status_mib

    return status_mib("VmRSS")


def _trim() -> None:
    """Free what can be freed (and glibc's free heap) so the RSS before a call is the live data."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def measure(fn: Callable[[], Any], repeats: int, cuda: bool = False) -> dict[str, Any]:
    """Run ``fn`` ``repeats`` times; each run's cost, and the minimum of each quantity."""
    from me_interp import usage

    runs = []
    for _ in range(repeats):
        _trim()
        before = _rss_mib()
        cuda_before = torch.cuda.memory_allocated() / 2**20 if cuda else None
        c0 = time.process_time()
        with usage.track() as u:
            fn()
            if cuda:
                torch.cuda.synchronize()
        cpu_s = time.process_time() - c0
        peak = u.peak_rss_mib
        runs.append(
            {
                "seconds": u.seconds,
                "cpu_seconds": cpu_s,
                "peak_rss_mib": peak,
                "rss_before_mib": before,
                "added_mib": None if peak is None or before is None else peak - before,
                "rss_scope": u.rss_scope,
                "peak_cuda_mib": u.peak_cuda_mib,
                "cuda_before_mib": cuda_before,
            }
        )
    best: dict[str, Any] = {"runs": runs}
    for key in ("seconds", "cpu_seconds", "peak_rss_mib", "added_mib", "peak_cuda_mib"):
        vals = [r[key] for r in runs if r[key] is not None]
        best[key] = min(vals) if vals else None
    return best


def growth_exponent(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """The least-squares slope of ``log y`` on ``log x`` (``y ∝ x^slope``); ``None`` with fewer
    than two points where both are positive."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if x > 0 and y and y > 0]
    return linear_slope([u for u, _ in pts], [v for _, v in pts])


def linear_slope(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """The least-squares slope of ``y`` on ``x``; ``None`` with fewer than two distinct ``x``."""
    n = len(xs)
    if n < 2:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


# ---- the plan ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Curve:
    """``bench`` measured at each ``x`` of the quantity ``vary``; ``base`` holds the others
    (``prompts``, ``tokens``, ``d_model``, ``n_layers``)."""

    bench: str
    vary: str
    xs: tuple[int, ...]
    base: dict

    def setting(self, x: int) -> dict:
        key = {"layers": "n_layers", "width": "d_model"}.get(self.vary, self.vary)
        return {**self.base, key: x}


def plan(quick: bool) -> list[Curve]:
    """The curves of the full run (sized for 15 minutes on one CPU thread; its measured time is in
    ``docs/scaling.md``) or of ``--quick``."""
    if quick:
        s, p, b = (
            {"prompts": 2, "tokens": 8, "d_model": 32, "n_layers": 2},
            {"prompts": 2, "tokens": 8, "d_model": 32, "n_layers": 2},
            {"prompts": 4, "tokens": 6, "n_layers": 3},
        )
        return [
            Curve("scan", "prompts", (2, 4), s),
            Curve("scan", "tokens", (8, 16), s),
            Curve("scan", "layers", (1, 2, 4), s),
            Curve("scan", "width", (32, 64), s),
            Curve("patching", "prompts", (2, 4), p),
            Curve("patching", "layers", (2, 3), p),
            Curve("battery", "layers", (3, 4), b),
        ]
    s = {"prompts": 8, "tokens": 32, "d_model": 768, "n_layers": 12}
    p = {"prompts": 8, "tokens": 32, "d_model": 256, "n_layers": 8}
    b = {"prompts": 16, "tokens": 10, "n_layers": 5}
    return [
        Curve("scan", "prompts", (8, 16, 32, 64, 128), s),
        Curve("scan", "tokens", (16, 32, 64, 128, 256, 512), s),
        Curve("scan", "layers", (2, 4, 8, 16, 24), {**s, "d_model": 2048}),
        Curve("scan", "width", (512, 1024, 1536, 2048, 3072), {**s, "n_layers": 8}),
        Curve("patching", "prompts", (8, 16, 32, 64, 128), p),
        Curve("patching", "tokens", (16, 32, 64, 128, 256), p),
        Curve("patching", "layers", (4, 8, 16, 24), p),
        Curve("patching", "width", (256, 512, 1024), p),
        Curve("battery", "prompts", (8, 32, 128), b),
        Curve("battery", "tokens", (10, 40, 120), b),
        Curve("battery", "layers", (4, 8, 16), b),
    ]


QUICK_BATTERY = ("me_layer", "attention_sinks")
"""The battery's experiments in ``--quick`` (the full run runs all of them)."""


def run_plan(curves: list[Curve], repeats: int, quick: bool, log=print) -> list[dict]:
    """Measure every point of ``curves``; a model is built once per shape and reused."""
    from me_interp import battery

    vocab = 256 if quick else 32000
    experiments = QUICK_BATTERY if quick else battery.NAMES
    cache: dict[Any, Any] = {}
    out = []
    with tempfile.TemporaryDirectory(prefix="bench_scaling_") as tmp:
        for c in curves:
            points = []
            for x in c.xs:
                st = c.setting(x)
                t0 = time.perf_counter()
                if c.bench == "battery":
                    cache.clear()
                    _trim()
                    model, fn = battery_work(
                        st["n_layers"], st["prompts"], st["tokens"], experiments, Path(tmp)
                    )
                else:
                    key = Shape(st["d_model"], st["n_layers"], vocab=vocab)
                    if key not in cache:
                        cache.clear()
                        _trim()
                        cache[key] = build(key)
                    model = cache[key]
                    work = scan_work if c.bench == "scan" else patching_work
                    fn = work(model, st["prompts"], st["tokens"])
                got = measure(fn, repeats)
                pt = {
                    "x": x,
                    **st,
                    "params": n_params(model),
                    "weight_mib": weight_mib(model),
                    **got,
                }
                if c.bench == "scan":
                    pt["full_cache_mib"] = full_cache_mib(model, st["prompts"], st["tokens"])
                points.append(pt)
                log(
                    f"{c.bench:8} {c.vary:7} x={x:<5} {got['seconds']:8.2f} s "
                    f"(CPU {got['cpu_seconds']:.2f} s)  peak RSS "
                    f"{got['peak_rss_mib']:7.0f} MiB (+{got['added_mib']:.0f})  "
                    f"[{time.perf_counter() - t0:.0f} s with setup]"
                )
            out.append(summarise(c, points))
        cache.clear()
    return out


def full_cache_mib(model, prompts: int, tokens: int) -> float:
    """What a cache of the 7 sites at every layer would hold for this batch (fp32), for comparison:
    the scan keeps none."""
    return 7 * model.n_layers * prompts * tokens * model.d_model * 4 / 2**20


def summarise(c: Curve, points: list[dict]) -> dict:
    xs = [p["x"] for p in points]
    return {
        "bench": c.bench,
        "vary": c.vary,
        "base": c.base,
        "points": points,
        "time_exponent": growth_exponent(xs, [p["seconds"] for p in points]),
        "cpu_time_exponent": growth_exponent(xs, [p["cpu_seconds"] for p in points]),
        "added_memory_exponent": growth_exponent(xs, [p["added_mib"] for p in points]),
    }


def memory_vs_layers(curves: list[dict]) -> dict | None:
    """The scan's peak memory above the weights as the layers grow: slopes in MiB per layer."""
    c = next((c for c in curves if c["bench"] == "scan" and c["vary"] == "layers"), None)
    if c is None:
        return None
    pts = c["points"]
    xs = [p["x"] for p in pts]
    above = [p["peak_rss_mib"] - p["weight_mib"] for p in pts]
    d = c["base"]["d_model"]
    B, T = c["base"]["prompts"], c["base"]["tokens"]
    return {
        "layers": xs,
        "weight_mib": [p["weight_mib"] for p in pts],
        "above_weights_mib": above,
        "added_mib": [p["added_mib"] for p in pts],
        "slope_above_weights_mib_per_layer": linear_slope(xs, above),
        "slope_added_mib_per_layer": linear_slope(xs, [p["added_mib"] for p in pts]),
        "weight_mib_per_layer": linear_slope(xs, [p["weight_mib"] for p in pts]),
        "statistics_mib_per_layer": statistics_bytes_per_layer(B, T, d) / 2**20,
    }


def statistics_bytes_per_layer(B: int, T: int, d: int, sites: int = 7, k: int = 16) -> int:
    """What ``probes.norms.NormRecorder`` keeps per layer (its full-batch outputs): the norms
    ``[site B T]`` fp32, top-k values fp32 and dims int64 ``[B T k]``, medians ``[B]`` and one
    prompt's layer output ``[T d]``."""
    return sites * B * T * 4 + B * T * k * (4 + 8) + B * 4 + T * d * 4


# ---- run information ----------------------------------------------------------------------


def meta(args, device: str = "cpu") -> dict[str, Any]:
    return {
        "quick": bool(getattr(args, "quick", False)),
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "device": device,
        "cuda_device": torch.cuda.get_device_name() if device.startswith("cuda") else None,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "commit": _commit(),
    }


def _commit() -> str | None:
    """The checkout's commit, with ``+dirty`` when the tree has uncommitted changes."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return None
    return (head + ("+dirty" if dirty else "")) or None


def point(args) -> dict[str, Any]:
    """``--point``: one bench on one config-built shape, on ``--device`` in ``--dtype``."""
    shape = Shape(args.d_model, args.n_layers, args.d_mlp, args.heads, args.kv_heads, args.vocab)
    t0 = time.perf_counter()
    model = build(shape, args.device, args.dtype)
    build_s = time.perf_counter() - t0
    work = scan_work if args.point == "scan" else patching_work
    fn = work(model, args.prompts, args.tokens)
    got = measure(fn, args.repeats, cuda=model.device.type == "cuda")
    res = {
        "meta": meta(args, str(model.device)),
        "bench": args.point,
        "shape": asdict(shape),
        "dtype": args.dtype,
        "prompts": args.prompts,
        "tokens": args.tokens,
        "params": n_params(model),
        "weight_mib": weight_mib(model),
        "build_seconds": build_s,
        **got,
    }
    if args.point == "scan":
        res["full_cache_mib"] = full_cache_mib(model, args.prompts, args.tokens) * (
            torch.finfo(getattr(torch, args.dtype)).bits / 32
        )
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny models and sizes (a smoke run)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per point (the minimum is kept)")
    ap.add_argument("--out", default="runs/scaling", help="where the JSON, SVG and tables go")
    ap.add_argument("--doc", default=None, help=f"rewrite the {DOC_SECTION} section of this file")
    ap.add_argument("--figure", default=None, help="also write the SVG figure here")
    ap.add_argument("--only", nargs="+", choices=BENCHES, default=list(BENCHES))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--from-json", default=None, help="no measuring: tables and figure of this scaling.json"
    )
    g = ap.add_argument_group("one point (--point)")
    g.add_argument("--point", choices=("scan", "patching"), default=None)
    g.add_argument("--d-model", type=int, default=4096)
    g.add_argument("--n-layers", type=int, default=32)
    g.add_argument("--d-mlp", type=int, default=None)
    g.add_argument("--heads", type=int, default=None)
    g.add_argument("--kv-heads", type=int, default=None)
    g.add_argument("--vocab", type=int, default=32000)
    g.add_argument("--prompts", type=int, default=8)
    g.add_argument("--tokens", type=int, default=512)
    g.add_argument("--device", default="cpu")
    g.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    g.add_argument("--json", default=None, help="with --point: write the measurement here")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    torch.set_num_threads(args.threads)

    if args.point:
        if min(args.d_model, args.n_layers, args.prompts, args.tokens, args.vocab) < 1:
            ap.error("--d-model, --n-layers, --prompts, --tokens and --vocab must be positive")
        res = point(args)
        print(
            f"{res['bench']} on a config-built Llama ({res['params'] / 1e9:.2f} B parameters, "
            f"{args.dtype}, {res['meta']['device']}): {args.prompts} prompts x {args.tokens} tokens, "
            f"{res['seconds']:.3f} s (min of {args.repeats}); weights {res['weight_mib']:.0f} MiB, "
            f"peak RSS {res['peak_rss_mib']:.0f} MiB"
            + (
                f", CUDA peak {res['peak_cuda_mib']:.0f} MiB "
                f"({res['peak_cuda_mib'] - res['weight_mib']:.0f} above the weights)"
                if res["peak_cuda_mib"] is not None
                else ""
            )
        )
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
        return 0

    if args.from_json:
        res = json.loads(Path(args.from_json).read_text(encoding="utf-8"))
        return write_outputs(res, args)
    curves = [c for c in plan(args.quick) if c.bench in args.only]
    t0 = time.perf_counter()
    print(
        f"bench_scaling: {len(curves)} curves, {sum(len(c.xs) for c in curves)} points, "
        f"{args.repeats} runs each (min kept), {torch.get_num_threads()} thread(s)",
        flush=True,
    )
    measured = run_plan(curves, args.repeats, args.quick, log=lambda s: print(s, flush=True))
    mem = memory_vs_layers(measured)
    res = {
        "meta": {
            **meta(args),
            "total_seconds": time.perf_counter() - t0,
            "total_cpu_seconds": time.process_time(),  # the whole process, model building included
        },
        "curves": measured,
        "memory_vs_layers": mem,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / JSON_FILE).write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
    return write_outputs(res, args)


def write_outputs(res: dict, args) -> int:
    """The tables and the figure of measured ``res`` into ``--out`` (and ``--doc``, ``--figure``)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = tables(res["curves"], res["memory_vs_layers"])
    (out / TABLES_FILE).write_text(text, encoding="utf-8")
    figure = svg(res["curves"], res["memory_vs_layers"])
    (out / SVG_FILE).write_text(figure, encoding="utf-8")
    print("\n" + text)
    print(f"total {res['meta']['total_seconds']:.0f} s; wrote {out / JSON_FILE}, {out / SVG_FILE}")
    if args.figure:
        Path(args.figure).write_text(figure, encoding="utf-8")
    if args.doc:
        replace_section(args.doc, DOC_SECTION, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
