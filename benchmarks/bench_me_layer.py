"""Benchmark: the full ME-layer scan (norms at 7 sites x every layer + localisation) vs a plain HF forward.

Both on the same batch (the first ``--n-prompts`` built-in prompts, each cut to its first ``--n-tokens``
tokens, so there is no padding and the scan runs as one chunk), same model object, fp32 (``--dtype``), one thread, in
one process; repeats are interleaved and the median over repeats of each repeat's ratio is printed, in
wall and in CPU time (target: <= 1.1x on CPU against the forward without the unembedding, the same
work). The scan's hooks keep their statistics on the activations' device and the results are copied
to the CPU once, after the forward (``me_interp.probes.norms``).

Measured (bundled SmolLM2-135M, 2-core machine shared with another session, ``docs/performance.md``):
before one hook per hook point, ``out=`` buffers and numpy / int32 selections, 1.22x (11 runs,
1.16-1.29); after, 1.12x wall, 1.11x CPU time (7 runs, 1.06-1.18); what remains is mostly
``torch.topk``, hook registration and ``locate_me_layer``.

    python benchmarks/bench_me_layer.py [--repeats 15] [--n-prompts 12] [--n-tokens 16] [--model synthetic:planted]
        [--device cuda --dtype bfloat16] [--json FILE] [--attention {eager,sdpa,both}]
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
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--json", default=None, help="also write the medians and ratios here")
    p.add_argument(
        "--attention",
        default="both",
        choices=("eager", "sdpa", "both"),
        help="the attention of the forwards and the scan (sdpa: me_interp's fused kernel, which "
        "the ME-layer experiment runs under; the plain forwards then use HF's sdpa too)",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from me_interp import load_model, names
    from me_interp.loading.attention import kernel
    from me_interp.probes import locate_me_layer, scan_norms
    from me_interp.prompts import builtin_prompts

    model = load_model(args.model, device=args.device, dtype=args.dtype)
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

    def paired(times: dict[str, list[float]], a: str, b: str) -> float:
        """The median over repeats of ``a / b`` within one repeat (drift on a shared machine
        cancels between neighbours)."""
        return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))

    print(
        f"model: {model.name}; {model.device}; batch {tuple(batch.tokens.shape)} (no padding); "
        f"threads {torch.get_num_threads()}"
    )
    res: dict = {
        "model": model.name,
        "device": str(model.device),
        "dtype": args.dtype,
        "batch": list(batch.tokens.shape),
        "repeats": args.repeats,
    }
    attentions = ("eager", "sdpa") if args.attention == "both" else (args.attention,)
    for att in attentions:
        # the same attention in the plain forwards and in the scan: HF's own sdpa under the kernel
        with kernel(model, att) as ran:
            for _, f in runs:  # warm-up
                f()
            wall: dict[str, list[float]] = {key: [] for key, _ in runs}
            cpu: dict[str, list[float]] = {key: [] for key, _ in runs}
            for _ in range(args.repeats):
                for key, f in runs:
                    t0, c0 = time.perf_counter(), time.process_time()
                    f()
                    wall[key].append(time.perf_counter() - t0)
                    cpu[key].append(time.process_time() - c0)
        med = {key: statistics.median(v) for key, v in wall.items()}
        print(f"attention: {ran} (the plain forwards and the scan alike)")
        print(f"  plain HF forward     : {med['hf'] * 1e3:8.1f} ms (median of {args.repeats})")
        print(f"  HF without unembed   : {med['blocks'] * 1e3:8.1f} ms (median of {args.repeats})")
        print(f"  ME-layer scan (full) : {med['scan'] * 1e3:8.1f} ms (median of {args.repeats})")
        print(f"  ratio scan / HF      : {paired(wall, 'scan', 'hf'):.2f}x (target <= {TARGET}x)")
        print(
            f"  ratio scan / HF without unembed: {paired(wall, 'scan', 'blocks'):.2f}x wall, "
            f"{paired(cpu, 'scan', 'blocks'):.2f}x CPU time (the same work: the scan stops "
            "before the unembedding)"
        )
        out = {
            "attention": ran,
            "median_seconds": med,
            "ratio_scan_hf": paired(wall, "scan", "hf"),
            "ratio_scan_blocks": paired(wall, "scan", "blocks"),
            "ratio_scan_blocks_cpu": paired(cpu, "scan", "blocks"),
        }
        if att == attentions[0]:
            res.update(out)  # the first attention's figures at the top level
        res.setdefault("by_attention", {})[att] = out
    if args.json:
        import json
        from pathlib import Path

        Path(args.json).write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
