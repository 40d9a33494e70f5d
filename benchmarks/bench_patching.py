"""Benchmark: batched activation patching (me_interp.patching) against transformer_lens.patching.

Same inputs, same metrics (the massive token's norm ratio at the last layer and its attention sink
after the ME layer), same corruption (the ME layer's FFN output of the massive token replaced by the
other tokens' mean, as a row-wise hook; TransformerLens gets it as a permanent hook). For each site
it prints, measured in one run:

* the wall time of TransformerLens (one forward per cell) and of me_interp with cell skipping
  (``skip_shared=True``: cells whose patch cannot change the metrics are not run, and each chunk
  runs only the blocks from its first patched layer) and without it (every cell, full forwards);
* both speed ratios to TransformerLens;
* the ratio to the **FLOP floor**: the matrix-multiply FLOPs a cell cannot avoid (blocks ``L …
  metric layer`` at positions ``p …`` for cell ``(L, p)``; per-head cells patch every position, so
  from position 0), summed over the cells that can change the metrics, at the FLOP rate of one plain
  batched forward measured here; 1.0 would be doing exactly that work at that rate;
* the same ratio with the two runs every exact sweep needs besides its cells added to the floor
  (``runs_seconds``: the corrupt run and the clean run, through the last block a metric reads, the
  clean one from the first block where it can differ), at the same rate;
* the largest difference to TransformerLens (equality), and the attribution-patching estimate's
  time and its Spearman rank agreement with exact patching over the cells;
* ``forward_seconds``: one plain forward of the same batch (every position's logits, the fastest of
  three), measured in the same run, the unit attribution's cost is given in.

The skipping sweep and attribution are timed as the fastest of ``--repeats`` runs (default 2), as
the floor's rate and the plain forward are the fastest of three: on a shared machine a single run
against a best-of-three reference reads the load as overhead. The rate and the plain forward are
measured again before each site, so each site's ratios compare times taken close together.

``--pairs FILE --metric logit_diff`` patches user pairs instead (clean and corrupt texts, the logit
metric at each pair's last token, no corruption hook; ``experiments/pairs/ioi32.jsonl``: 32 IOI
pairs of 16 tokens), TransformerLens's reference being the same functions on the corrupt tokens
with the clean cache. The FLOP rate is that of a blocks-only forward (stopped at the final norm) of
the prompts tiled to 64 rows, the fastest of three; where a metric reads logits the floor also
counts each row's last-token unembedding.

TransformerLens runs every cell, or with ``--tl-cells N`` a random N of them (its time is then
scaled to all cells, and equality is checked on those N) — for the longer benchmark, where one
forward per cell takes an hour on this CPU; ``--all-layers N`` likewise times the full-forward sweep
on N random layers.

    python benchmarks/bench_patching.py                                  # 4 prompts x 8 tokens
    python benchmarks/bench_patching.py --n-prompts 16 --n-tokens 64 --layers 4 12 20 29 \
        --positions 0 1 8 32 63 --tl-cells 8
    python benchmarks/bench_patching.py --pairs experiments/pairs/ioi32.jsonl --metric logit_diff \
        --tl-cells 24 --all-layers 3
    python benchmarks/bench_patching.py --sites resid_pre attn_head_out
    python benchmarks/bench_patching.py --device cuda --json patching.json
"""

from __future__ import annotations

import argparse
import os
import time
from functools import partial

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")  # transformer_lens.patching draws a bar per sweep

import numpy as np
import pandas as pd
import torch

torch.set_num_threads(1)

from transformer_lens import patching as tl_patching  # noqa: E402

from me_interp import load_model  # noqa: E402
from me_interp.interventions import causal  # noqa: E402
from me_interp.models import Batch  # noqa: E402
from me_interp.patching import (  # noqa: E402
    HEAD_SITES,
    LOGITS,
    NormRatio,
    SinkMass,
    attribution_sweep,
    patch_sweep,
    rank_agreement,
)
from me_interp.patching.metrics import hook_layer  # noqa: E402
from me_interp.patching.pairs import (  # noqa: E402
    LOGIT_METRICS,
    logit_metric,
    read_pairs,
    tokenize_pairs,
)
from me_interp.patching.suffix import gather_last  # noqa: E402
from me_interp.patching.sweep import _index, site_hook  # noqa: E402
from me_interp.probes import Activations, record  # noqa: E402
from me_interp.probes.batching import stop_hook_name  # noqa: E402
from me_interp.probes.site import locate  # noqa: E402
from me_interp.prompts import builtin_prompts  # noqa: E402

TL_FUNCS = {
    "resid_pre": tl_patching.get_act_patch_resid_pre,
    "attn_out": tl_patching.get_act_patch_attn_out,
    "mlp_out": tl_patching.get_act_patch_mlp_out,
    "attn_head_out": tl_patching.get_act_patch_attn_head_out_all_pos,
}
TL_AXES = {"attn_head_out": ("layer", "head")}


def tl_sweep(model, clean, corrupt, corrupt_hooks, site, metrics, index_df):
    """TransformerLens's patching function of ``site`` over the cells of ``index_df``: the corrupt
    tokens with the clean run's cache; activations a metric reads come from permanent recording
    hooks (the corruption hooks are permanent too), logits at each row's last real token."""
    store: dict = {}

    def rec(x, hook, key):
        store[key] = x.detach().clone()
        return x

    bridge = model.bridge
    mask = corrupt.attention_mask.bool()
    _, cache = bridge.run_with_cache(clean.tokens, attention_mask=clean.attention_mask)
    try:
        for name, fn in corrupt_hooks:
            bridge.add_hook(name, fn, is_permanent=True)
        for m in metrics.values():
            for n in m.hook_names():
                if n != LOGITS:
                    bridge.add_hook(n, partial(rec, key=n), is_permanent=True)

        def score(logits, m):
            return m({**store, LOGITS: gather_last(logits, mask)}, mask)

        fns = {k: partial(score, m=m) for k, m in metrics.items()}
        res = TL_FUNCS[site](
            bridge,
            corrupt.tokens,
            cache,
            fns,
            reduce="none",
            index_df=index_df,
            index_axis_names=None,
        )
    finally:
        bridge.reset_hooks(including_permanent=True)
    return {k: res[k].values for k in metrics}  # [cell batch], cells in index_df order


def block_flops(model, T: int) -> tuple[float, float]:
    """Matrix-multiply FLOPs per token of one block (weights) and per query-key pair (attention)."""
    b = model.bridge.blocks[0]
    weights = sum(p.numel() for n, p in b.named_parameters() if p.dim() == 2)
    cfg = model.bridge.cfg
    return 2.0 * weights, 4.0 * cfg.n_heads * cfg.d_head  # QK^T and AV per (q, k) pair


def unembed_flops(model) -> float:
    """Matrix-multiply FLOPs of the unembedding of one position."""
    return 2.0 * model.bridge.cfg.d_model * model.bridge.cfg.d_vocab


def floor_flops(model, sw, B: int, T: int, last: int, start, logits: bool = False) -> float:
    """The FLOPs the cells that can change the metrics cannot avoid: cell (L, p) needs blocks
    L..last at positions p.., a cell patching every position (per-head, whole sequence) blocks
    L..last from the first position where its clean and corrupt activations differ, and, where a
    metric reads logits, the unembedding of each row's last token. ``start(li, pi, hi)`` is that
    first position, ``None`` for a cell that cannot change the metrics."""
    per_tok, per_pair = block_flops(model, T)
    per_row = unembed_flops(model) if logits else 0.0
    total = 0.0
    for li, layer in enumerate(sw.layers):
        for pi in range(len(sw.positions or [None])):
            for hi in range(len(sw.heads or [None])):
                p = start(li, pi, hi)
                if p is None:
                    continue
                q = T - p  # queries that change
                pairs = sum(range(p + 1, T + 1))  # each query q attends to q + 1 keys
                total += (last - layer + 1) * B * (q * per_tok + pairs * per_pair) + B * per_row
    return total


def _massive_setup(model, args, ap):
    """The massive-activation workload: built-in prompts, the norm-ratio and sink metrics, the
    ME layer's FFN output of the massive token removed by a row-wise hook (clean = corrupt tokens)."""
    texts = builtin_prompts()
    if args.n_tokens > 32:  # the built-in prompts are short: join neighbours to reach the length
        texts = [" ".join(texts[i : i + 4]) for i in range(0, len(texts) - 3, 4)]
    clean = causal.prompt_batch(model, texts, args.n_tokens, args.n_prompts).batch
    if clean.tokens.shape[1] < args.n_tokens or clean.padded:
        ap.error(f"the prompts give {clean.tokens.shape[1]} tokens, not --n-tokens {args.n_tokens}")
    site = locate(model, clean)
    site.require()
    p, last = site.position, model.n_layers - 1
    metrics = {
        "norm_ratio": NormRatio(last, p),
        "sink": SinkMass(tuple(range(site.layer + 1, model.n_layers)), p),
    }
    hooks = causal.remove_massive(
        model, clean, site.layer, [p], None, site="ffn_out", per_prompt=False
    )
    return clean, clean, metrics, hooks, f"ME layer {site.layer}"


def _pairs_setup(model, args, ap):
    """User pairs (``--pairs``): clean and corrupt texts, a logit metric at the last token, no
    corruption hook."""
    pb = tokenize_pairs(model, read_pairs(args.pairs))
    if args.n_prompts_given:
        pb = tokenize_pairs(model, pb.pairs[: args.n_prompts])
    metrics = {args.metric: logit_metric(args.metric, pb)}
    return pb.clean, pb.corrupt, metrics, [], f"pairs {args.pairs}, metric {args.metric}"


class _Stopped(Exception):
    pass


def _stop(x, hook):
    raise _Stopped


def blocks_forward(model, batch) -> None:
    """One forward of ``batch`` through the blocks only (stopped at the final norm's input: the
    bridge's ``stop_at_layer=n_layers`` would also unembed every position)."""
    with torch.no_grad():
        try:
            model.bridge.run_with_hooks(
                batch.tokens,
                attention_mask=batch.attention_mask,
                fwd_hooks=[(stop_hook_name(model), _stop)],
            )
        except _Stopped:
            return
    raise RuntimeError("the blocks-only forward did not stop at the final norm")


def plain_forward_seconds(model, batch, repeats: int = 3) -> float:
    """The fastest of ``repeats`` plain forwards of ``batch`` (every position's logits), after one
    warm-up: what "one forward" costs on this batch in this run."""
    best = float("inf")
    with torch.no_grad():
        model.bridge(batch.tokens, attention_mask=batch.attention_mask)
        for _ in range(repeats):
            t = time.perf_counter()
            model.bridge(batch.tokens, attention_mask=batch.attention_mask)
            best = min(best, time.perf_counter() - t)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    ap.add_argument(
        "--sites", nargs="+", default=["resid_pre", "attn_head_out"], choices=sorted(TL_FUNCS)
    )
    ap.add_argument("--n-prompts", type=int, default=None, help="default 4 (--pairs: every pair)")
    ap.add_argument("--n-tokens", type=int, default=8)
    ap.add_argument(
        "--pairs", default=None, help="a JSONL pairs file (me_interp.patching.pairs) to patch"
    )
    ap.add_argument("--metric", default="logit_diff", choices=LOGIT_METRICS[:2])
    ap.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="rows per forward of the sweep (default: chosen by the sweep from its work)",
    )
    ap.add_argument("--layers", type=int, nargs="+", default=None, help="default: every layer")
    ap.add_argument(
        "--positions", type=int, nargs="+", default=None, help="default: every position"
    )
    ap.add_argument("--tl-cells", type=int, default=None, help="time TL on this many random cells")
    ap.add_argument(
        "--all-layers",
        type=int,
        default=None,
        help="time the full-forward sweep on this many random layers (scaled to all)",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="time the skipping sweep and attribution as the fastest of this many runs (the "
        "floor's rate and the plain forward are the fastest of three)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--json", default=None, help="also write each site's times and ratios here")
    args = ap.parse_args(argv)
    args.n_prompts_given = args.n_prompts is not None
    if args.n_prompts is None:
        args.n_prompts = 4

    model = load_model(args.model, device=args.device, dtype=args.dtype)
    setup = _pairs_setup if args.pairs else _massive_setup
    clean, corrupt, metrics, hooks, what = setup(model, args, ap)
    B, T = clean.tokens.shape
    layers = args.layers or list(range(model.n_layers))
    # the FLOP rate of a plain batched forward of the same prompts tiled to 64 rows (the fastest
    # of three), and one plain forward of the batch itself: measured again before each site, so
    # that each site's ratios compare times taken close together on a shared machine
    tile = max(1, 64 // B)
    rows = Batch(clean.tokens.repeat(tile, 1), clean.attention_mask.repeat(tile, 1), None)
    per_tok, per_pair = block_flops(model, T)
    fwd_flops = rows.tokens.shape[0] * model.n_layers * (T * per_tok + T * (T + 1) / 2 * per_pair)

    def measure_rate() -> float:
        best = float("inf")
        for i in range(4):
            t = time.perf_counter()
            blocks_forward(model, rows)
            if i:
                best = min(best, time.perf_counter() - t)
        return fwd_flops / best

    rate = measure_rate()
    forward_secs = plain_forward_seconds(model, corrupt)
    print(
        f"model {model.name}; {what}; {B} prompts x {T} tokens; layers "
        f"{layers[0]}..{layers[-1]} ({len(layers)}); torch threads {torch.get_num_threads()}; "
        f"plain forward {rate / 1e9:.1f} GFLOP/s (blocks' matrix multiplies); one plain forward "
        f"of the batch {forward_secs:.3f} s; sweeps and attribution: the fastest of "
        f"{args.repeats} runs"
    )
    rng = np.random.default_rng(args.seed)
    results: dict = {
        "model": model.name,
        "device": str(model.device),
        "dtype": args.dtype,
        "workload": what,
        "prompts": B,
        "tokens": T,
        "forward_seconds": forward_secs,
        "sites": {},
    }
    batch_kw = {} if args.batch_size is None else {"batch_size": args.batch_size}
    for s in args.sites:
        head = s in HEAD_SITES
        kw = {"layers": layers, "per_position": not head}
        if not head:
            kw["positions"] = args.positions
        got, secs = {}, {}
        rate = measure_rate()
        forward_secs = plain_forward_seconds(model, corrupt)
        # the full-forward sweep costs the same per cell: timed on --all-layers random layers
        all_layers = layers
        if args.all_layers is not None and args.all_layers < len(layers):
            all_layers = sorted(rng.choice(layers, args.all_layers, replace=False).tolist())
        for skip in (True, False):
            secs[skip] = float("inf")
            for _ in range(args.repeats if skip else 1):  # the full forwards: one run
                t = time.perf_counter()
                got[skip] = patch_sweep(
                    model,
                    clean,
                    corrupt,
                    s,
                    metrics,
                    corrupt_hooks=hooks,
                    progress=False,
                    skip_shared=skip,
                    **batch_kw,
                    **{**kw, "layers": layers if skip else all_layers},
                )
                secs[skip] = min(secs[skip], time.perf_counter() - t)
        secs[False] *= len(layers) / len(all_layers)
        secs["attribution"] = float("inf")
        for _ in range(args.repeats):
            t = time.perf_counter()
            attr = attribution_sweep(model, clean, corrupt, s, metrics, corrupt_hooks=hooks, **kw)
            secs["attribution"] = min(secs["attribution"], time.perf_counter() - t)
        sw = got[True]
        axes = TL_AXES.get(s, ("layer", "pos"))
        grid = [sw.layers, sw.heads] if head else [sw.layers, sw.positions]
        cells = pd.MultiIndex.from_product(grid, names=list(axes)).to_frame(index=False)
        n_cells = len(cells)
        if args.tl_cells is not None and args.tl_cells < n_cells:
            cells = cells.iloc[np.sort(rng.choice(n_cells, args.tl_cells, replace=False))]
        t = time.perf_counter()
        ref = tl_sweep(model, clean, corrupt, hooks, s, metrics, cells.reset_index(drop=True))
        tl_secs = (time.perf_counter() - t) * n_cells / len(cells)
        idx = [
            tuple(
                sw.layers.index(r[0]) if i == 0 else (sw.heads or sw.positions).index(r[i])
                for i in range(2)
            )
            for r in cells.itertuples(index=False)
        ]
        diff = max(
            float(
                (torch.stack([got[True].values[m][i] for i in idx]).double() - ref[m].double())
                .abs()
                .max()
            )
            for m in metrics
        )
        # the full-forward sweep on the TL cells of its layers
        both = [(j, i) for j, i in enumerate(idx) if sw.layers[i[0]] in all_layers]
        for m in metrics:
            for j, (li, x) in both:
                a = got[False].values[m][all_layers.index(sw.layers[li]), x].double()
                diff = max(diff, float((a - ref[m][j].double()).abs().max()))

        run_cells = sw.n_cells_run
        # the cells that can change the metrics: the ones the skipping sweep runs
        floor = _floor_of_run(model, sw, B, T, hooks, clean, corrupt, metrics)
        floor_secs = floor / rate
        runs_secs = _baseline_flops(model, B, T, hooks, clean, corrupt, metrics) / rate
        rho = {m: rank_agreement(attr, sw, m) for m in metrics}
        sampled = "" if len(cells) == n_cells else f" (timed on {len(cells)} random cells, scaled)"
        print(f"\nsite {s}: {n_cells} cells, {run_cells} can change the metrics")
        print(f"  transformer_lens.patching    {tl_secs:8.2f} s{sampled}")
        for skip in (True, False):
            print(
                f"  me_interp skip_shared={str(skip):5} {secs[skip]:8.2f} s  x{tl_secs / secs[skip]:6.2f} vs TL  "
                f"{secs[skip] / floor_secs:6.2f}x the FLOP floor  ({got[skip].n_forwards} forwards)"
            )
        print(
            f"  FLOP floor                   {floor_secs:8.2f} s  ({floor / 1e12:.3g} TFLOP at the plain-forward rate)"
        )
        print(
            f"  + the clean and corrupt runs {runs_secs:8.2f} s  (at that rate): sweep / (floor + runs) "
            f"{secs[True] / (floor_secs + runs_secs):.2f}x"
        )
        print(
            f"  attribution patching         {secs['attribution']:8.2f} s  x{tl_secs / secs['attribution']:6.1f} vs TL; "
            f"{secs['attribution'] / forward_secs:.2f} plain forwards; "
            f"rank agreement with exact: " + ", ".join(f"{m} {v:.3f}" for m, v in rho.items())
        )
        print(f"  one plain forward of the batch {forward_secs:6.3f} s")
        print(f"  max |difference| to transformer_lens: {diff:.3g}")
        print(
            f"  speed ratio vs TL: with cell skipping {tl_secs / secs[True]:.2f}x, without {tl_secs / secs[False]:.2f}x; "
            f"ratio to the FLOP floor {secs[True] / floor_secs:.2f}x"
        )
        results["sites"][s] = {
            "gflops_per_s": rate / 1e9,
            "cells": n_cells,
            "cells_run": run_cells,
            "tl_cells_timed": len(cells),
            "tl_seconds": tl_secs,
            "seconds_skip": secs[True],
            "seconds_all": secs[False],
            "all_layers_timed": len(all_layers),
            "floor_seconds": floor_secs,
            "runs_seconds": runs_secs,
            "skip_over_floor_and_runs": secs[True] / (floor_secs + runs_secs),
            "attribution_seconds": secs["attribution"],
            "forward_seconds": forward_secs,
            "skip_over_floor": secs[True] / floor_secs,
            "attribution_over_forward": secs["attribution"] / forward_secs,
            "rank_agreement": rho,
            "max_diff_tl": diff,
            "n_forwards_skip": sw.n_forwards,
        }
    if args.json:
        import json
        from pathlib import Path

        Path(args.json).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    return 0


def _baseline_flops(model, B, T, hooks, clean, corrupt, metrics) -> float:
    """The matrix-multiply FLOPs of the two runs every exact sweep needs besides its cells: the
    corrupt run (the baseline, and the activations the cells start from) and the clean run (the
    activations patched in), each through the last block a metric reads (and each row's last-token
    unembedding for logit metrics); the clean run from the first block where it can differ from
    the corrupt one (the first corruption hook's block when the tokens are the same)."""
    per_tok, per_pair = block_flops(model, T)
    reads = {n for m in metrics.values() for n in m.hook_names()}
    last = max(hook_layer(n, model.n_layers) for n in reads)
    per_block = B * (T * per_tok + T * (T + 1) / 2 * per_pair)
    unembed = B * unembed_flops(model) if LOGITS in reads else 0.0
    first = 0
    if hooks and torch.equal(clean.tokens, corrupt.tokens):
        first = min(hook_layer(n, model.n_layers) for n, _ in hooks)
    return (last + 1) * per_block + (last + 1 - first) * per_block + 2 * unembed


def _floor_of_run(model, sw, B, T, hooks, clean, corrupt, metrics) -> float:
    """:func:`floor_flops` over the cells that can change the metrics (the others: their clean
    and corrupt activations are equal, or they lie after the last layer a metric reads), each from
    the first position it changes, less the cells whose patched run is the clean run (their work is
    in ``runs_seconds``) — measured here, independently of the sweep."""
    names_ = {layer: site_hook(sw.site, layer) for layer in sw.layers}
    clean_acts = Activations(model, clean, list(names_.values()))
    record(model, clean, [clean_acts], last_layer=clean_acts.last_layer, max_tokens=None)
    corrupt_acts = Activations(model, corrupt, list(names_.values()))
    record(model, corrupt, [corrupt_acts], fwd_hooks=hooks, last_layer=corrupt_acts.last_layer)
    reads = {n for m in metrics.values() for n in m.hook_names()}
    last = max(hook_layer(n, model.n_layers) for n in reads)
    ar = torch.arange(B)
    starts = {}
    first_read = min(hook_layer(n, model.n_layers) for n in reads)

    def repeats_clean(layer: int, ix) -> bool:
        """Whether patching ``ix`` makes the whole stream entering ``layer`` the clean run's, with
        no corruption hook from there on and every metric read later: the clean run is that run."""
        if sw.site != "resid_pre" or layer > first_read:
            return False
        if any(hook_layer(n, model.n_layers) >= layer for n, _ in hooks):
            return False
        patched = corrupt_acts[names_[layer]].clone()
        patched[ix] = clean_acts[names_[layer]][ix]
        return torch.equal(patched, clean_acts[names_[layer]])

    for li, layer in enumerate(sw.layers):
        for pi in range(len(sw.positions or [None])):
            for hi in range(len(sw.heads or [None])):
                pos = None if sw.positions is None else torch.full((B,), sw.positions[pi])
                head = None if sw.heads is None else torch.full((B,), sw.heads[hi])
                ix = _index(sw.site, ar, pos, head)
                a, b = clean_acts[names_[layer]][ix], corrupt_acts[names_[layer]][ix]
                if layer > last or torch.equal(a, b) or repeats_clean(layer, ix):
                    continue
                if sw.positions is not None:
                    starts[li, pi, hi] = sw.positions[pi]
                else:  # [B pos ...] after the index: the first position that differs
                    differ = (a != b).reshape(B, a.shape[1], -1).any(-1).any(0)
                    starts[li, pi, hi] = int(differ.nonzero()[0, 0])
    return floor_flops(model, sw, B, T, last, lambda *c: starts.get(c), logits=LOGITS in reads)


if __name__ == "__main__":
    raise SystemExit(main())
