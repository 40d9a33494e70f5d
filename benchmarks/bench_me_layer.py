"""Benchmark: the full ME-layer scan (norms at 7 sites x every layer + localisation) vs a plain HF forward.

Both on the same batch (the built-in prompts), same model object, fp32, one thread, in one process;
repeats are interleaved and the median of each is compared. Prints the ratio (target: <= 1.3x).

    python benchmarks/bench_me_layer.py [--repeats 15] [--model synthetic:planted]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from me_interp import load_model, names
    from me_interp.probes import locate_me_layer, scan_norms
    from me_interp.prompts import builtin_prompts

    model = load_model(args.model, device="cpu", dtype="float32")
    batch = model.tokenize(builtin_prompts())

    def hf_forward():
        with torch.no_grad():
            model.hf(input_ids=batch.tokens, attention_mask=batch.attention_mask, use_cache=False)

    def me_scan():
        locate_me_layer(scan_norms(model, batch, names.SITES))

    for f in (hf_forward, me_scan):  # warm-up
        f()
    times = {"hf": [], "scan": []}
    for _ in range(args.repeats):
        for key, f in (("hf", hf_forward), ("scan", me_scan)):
            t0 = time.perf_counter()
            f()
            times[key].append(time.perf_counter() - t0)
    hf_t, scan_t = statistics.median(times["hf"]), statistics.median(times["scan"])
    print(f"model: {model.name}; batch {tuple(batch.tokens.shape)}; threads {args.threads}")
    print(f"plain HF forward     : {hf_t * 1e3:8.1f} ms (median of {args.repeats})")
    print(f"ME-layer scan (full) : {scan_t * 1e3:8.1f} ms (median of {args.repeats})")
    print(f"ratio scan / HF      : {scan_t / hf_t:.2f}x (target <= 1.3x)")


if __name__ == "__main__":
    main()
