"""Benchmark: the ME-layer scan with the bridge's eager attention vs the fused kernel (sdpa).

TransformerLens 4.3's attention bridge recomputes attention itself (``q kᵀ``, softmax, ``· v``: the
``[batch, head, pos, pos]`` scores and pattern exist for ``hook_pattern``) whatever HF's
``attn_implementation`` says; ``me_interp.loading.attention.kernel(model, "sdpa")`` routes each
attention through HF's own forward with ``scaled_dot_product_attention`` instead (what the ME-layer
scan, the weight experiments and WeMask's perplexities run under, ``ATTENTION = "sdpa"``).

For each sequence length: the same batch (``--n-prompts`` rows of random token ids, no padding, one
chunk), the full scan (``scan_norms`` at every site + ``locate_me_layer``), eager and sdpa
interleaved ``--repeats`` times after a warm-up, one thread, fp32. Prints the median wall time of
each and the median of the per-repeat ratios, the peak memory of one scan above the loaded model in a
fresh process after a warm-up scan, with glibc giving every freed block of 64 KiB or more back to the
system (the RSS high-water mark within the scan, ``me_interp.usage.track``; the CUDA peak on a GPU),
and the largest relative difference of the scan's statistics (token norms at every site, top-k
values, medians) between the two, which the tests bound (``tests/test_offload.py``).

    python benchmarks/bench_attention.py [--lengths 64 256 1024] [--n-prompts 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest ``|a - b| / |b|`` over the entries of ``b`` that are not zero."""
    a, b = a.double(), b.double()
    nz = b != 0
    return float(((a - b).abs()[nz] / b.abs()[nz]).max()) if nz.any() else 0.0


def scan_difference(x, y) -> float:
    """The largest relative difference between two ``NormScan``s' statistics."""
    return max(
        rel_diff(x.norms, y.norms),
        rel_diff(x.top_abs, y.top_abs),
        rel_diff(x.median_abs, y.median_abs),
    )


def _fresh_peak(args: argparse.Namespace, attention: str, length: int) -> float:
    """The peak memory above the loaded model of one scan with ``attention`` (after a warm-up
    scan), in a fresh process whose allocator gives large blocks back when they are freed."""
    cmd = [sys.executable, __file__, "--one", attention, "--lengths", str(length)]
    cmd += ["--n-prompts", str(args.n_prompts), "--device", args.device]
    cmd += ["--threads", str(args.threads)] + (["--model", args.model] if args.model else [])
    # glibc returns every block of 64 KiB or more to the system when freed (no dynamic threshold),
    # so the resident set follows the live tensors and the high-water mark is the scan's own peak
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    return float(next(line for line in out.splitlines() if line.startswith("PEAK")).split()[1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--n-prompts", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--one", choices=("eager", "sdpa"), default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from me_interp import load_model, names, usage
    from me_interp.loading.attention import kernel
    from me_interp.probes import locate_me_layer, scan_norms

    model = load_model(args.model, device=args.device, dtype="float32")
    cuda = model.device.type == "cuda"
    gen = torch.Generator().manual_seed(0)
    if args.one is None:
        print(f"model: {model.name}; {model.device}; fp32; threads {torch.get_num_threads()}")
        print("tokens  eager ms  sdpa ms  eager/sdpa  peak MiB eager  peak MiB sdpa  max rel diff")
    for length in args.lengths:
        ids = torch.randint(
            100, model.bridge.cfg.d_vocab - 1, (args.n_prompts, length), generator=gen
        )
        batch = model.batch_from_ids([row.tolist() for row in ids])

        def scan(attention: str, batch=batch):
            with kernel(model, attention) as ran:
                assert ran == attention, f"{attention} asked, {ran} ran"
                s = scan_norms(model, batch, names.SITES)
                locate_me_layer(s)
            if cuda:
                torch.cuda.synchronize()
            return s

        if args.one is not None:  # a fresh process: a scan's peak above the loaded model
            scan(args.one)  # one-off costs of a first forward are not the scan's
            before = torch.cuda.memory_allocated() / 2**20 if cuda else _rss_mib()
            with usage.track() as u:
                scan(args.one)
            top = u.peak_cuda_mib if cuda else u.peak_rss_mib
            print(f"PEAK {(top or 0.0) - before:.1f}")
            return 0
        scans = {a: scan(a) for a in ("eager", "sdpa")}  # warm-up, and the statistics compared
        wall: dict[str, list[float]] = {"eager": [], "sdpa": []}
        for _ in range(args.repeats):
            for a in ("eager", "sdpa"):
                t0 = time.perf_counter()
                scan(a)
                wall[a].append(time.perf_counter() - t0)
        ratio = statistics.median(e / s for e, s in zip(wall["eager"], wall["sdpa"], strict=True))
        peak = {a: _fresh_peak(args, a, length) for a in ("eager", "sdpa")}
        print(
            f"{length:6d}  {statistics.median(wall['eager']) * 1e3:8.0f}  "
            f"{statistics.median(wall['sdpa']) * 1e3:7.0f}  {ratio:10.2f}  "
            f"{peak['eager']:14.1f}  {peak['sdpa']:13.1f}  "
            f"{scan_difference(scans['sdpa'], scans['eager']):12.2e}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
