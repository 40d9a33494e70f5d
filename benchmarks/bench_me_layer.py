"""Benchmark: the full ME-layer scan (norms at 7 sites x every layer + localisation) vs a plain HF forward.

Both on the same batch (the first ``--n-prompts`` built-in prompts, each cut to its first ``--n-tokens``
tokens, so there is no padding and the scan runs as one chunk), same model object, fp32, one thread, in
one process; repeats are interleaved and the median of each is compared. Prints the ratio (target:
<= 1.1x on CPU). The scan's hooks keep their statistics on the activations' device and the results
are copied to the CPU once, after the forward (``me_interp.probes.norms``).

    python benchmarks/bench_me_layer.py [--repeats 15] [--n-prompts 12] [--n-tokens 16] [--model synthetic:planted]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

TARGET = 1.1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--n-prompts", type=int, default=12)
    p.add_argument("--n-tokens", type=int, default=16, help="built-in prompts have >= 16 tokens")
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from me_interp import load_model, names
    from me_interp.probes import locate_me_layer, scan_norms
    from me_interp.prompts import builtin_prompts

    model = load_model(args.model, device=args.device, dtype="float32")
    full = model.tokenize(builtin_prompts()[: args.n_prompts])
    if min(full.lengths) < args.n_tokens:
        p.error(
            f"--n-tokens {args.n_tokens} is longer than the shortest prompt ({min(full.lengths)})"
        )
    batch = model.batch_from_ids([row[: args.n_tokens].tolist() for row in full.tokens])
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)

    def hf_forward():
        with torch.no_grad():
            model.hf(input_ids=batch.tokens, attention_mask=batch.attention_mask, use_cache=False)
        sync()

    def hf_blocks():  # the same forward without the unembedding, which the scan skips
        with torch.no_grad():
            model.hf.model(
                input_ids=batch.tokens, attention_mask=batch.attention_mask, use_cache=False
            )
        sync()

    def me_scan():
        locate_me_layer(scan_norms(model, batch, names.SITES))  # results on the CPU: synced

    runs = (("hf", hf_forward), ("blocks", hf_blocks), ("scan", me_scan))
    for _, f in runs:  # warm-up
        f()
    times: dict[str, list[float]] = {key: [] for key, _ in runs}
    for _ in range(args.repeats):
        for key, f in runs:
            t0 = time.perf_counter()
            f()
            times[key].append(time.perf_counter() - t0)
    hf_t, scan_t = statistics.median(times["hf"]), statistics.median(times["scan"])
    blocks_t = statistics.median(times["blocks"])
    print(
        f"model: {model.name}; {model.device}; batch {tuple(batch.tokens.shape)} (no padding); "
        f"threads {torch.get_num_threads()}"
    )
    print(f"plain HF forward     : {hf_t * 1e3:8.1f} ms (median of {args.repeats})")
    print(f"HF without unembed   : {blocks_t * 1e3:8.1f} ms (median of {args.repeats})")
    print(f"ME-layer scan (full) : {scan_t * 1e3:8.1f} ms (median of {args.repeats})")
    print(f"ratio scan / HF      : {scan_t / hf_t:.2f}x (target <= {TARGET}x)")
    print(
        f"ratio scan / HF without unembed: {scan_t / blocks_t:.2f}x (the same work: the scan stops "
        "before the unembedding)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
