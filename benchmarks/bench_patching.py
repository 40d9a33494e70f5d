"""Benchmark: batched activation patching (me_interp.patching) against transformer_lens.patching.

Same inputs, same metrics (the massive token's norm ratio at the last layer and its attention sink
after the ME layer), same corruption (the ME layer's FFN output of the massive token replaced by the
other tokens' mean, as a row-wise hook; TransformerLens gets it as a permanent hook). Prints the wall
time of each method, the largest difference between the results, and *both* speed ratios on the same
inputs: with cell skipping (``skip_shared=True``: cells whose patch cannot change the metrics are not
run) and without it (every cell run, as TransformerLens does). The first is the everyday speed-up; the
second is what batching alone gives.

    python benchmarks/bench_patching.py                       # bundled model, resid_pre
    python benchmarks/bench_patching.py --site mlp_out --n-prompts 4 --n-tokens 8
"""

from __future__ import annotations

import argparse
import os
import time
from functools import partial

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

torch.set_num_threads(1)

from transformer_lens import patching as tl_patching  # noqa: E402

from me_interp import load_model  # noqa: E402
from me_interp.interventions import causal  # noqa: E402
from me_interp.patching import NormRatio, SinkMass, patch_sweep  # noqa: E402
from me_interp.prompts import builtin_prompts  # noqa: E402

TL_FUNCS = {
    "resid_pre": tl_patching.get_act_patch_resid_pre,
    "attn_out": tl_patching.get_act_patch_attn_out,
    "mlp_out": tl_patching.get_act_patch_mlp_out,
}


def tl_sweep(model, clean, corrupt_hooks, site, metrics):
    store: dict = {}

    def rec(x, hook, key):
        store[key] = x.detach().clone()
        return x

    bridge = model.bridge
    mask = clean.attention_mask.bool()
    _, cache = bridge.run_with_cache(clean.tokens)
    try:
        for name, fn in corrupt_hooks:
            bridge.add_hook(name, fn, is_permanent=True)
        for m in metrics.values():
            for n in m.hook_names():
                bridge.add_hook(n, partial(rec, key=n), is_permanent=True)
        fns = {k: (lambda logits, m=m: m(store, mask)) for k, m in metrics.items()}
        res = TL_FUNCS[site](bridge, clean.tokens, cache, fns, reduce="none")
    finally:
        bridge.reset_hooks(including_permanent=True)
    return {k: res[k].values for k in metrics}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    ap.add_argument("--site", default="resid_pre", choices=sorted(TL_FUNCS))
    ap.add_argument("--n-prompts", type=int, default=4)
    ap.add_argument("--n-tokens", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=64)
    args = ap.parse_args(argv)

    model = load_model(args.model, device="cpu", dtype="float32")
    # the experiment's own batch: n_prompts spread over the built-in set, cut to n_tokens each
    clean = causal.prompt_batch(model, builtin_prompts(), args.n_tokens, args.n_prompts).batch
    site = causal.locate_massive(model, clean)
    p, last = site.position, model.n_layers - 1
    metrics = {
        "norm_ratio": NormRatio(last, p),
        "sink": SinkMass(tuple(range(site.layer + 1, model.n_layers)), p),
    }
    hooks = causal.remove_massive(
        model, clean, site.layer, [p], None, site="ffn_out", per_prompt=False
    )
    n_cells = model.n_layers * clean.tokens.shape[1]
    print(
        f"model {model.name}; ME layer {site.layer}; site {args.site}; {len(clean)} prompts x "
        f"{clean.tokens.shape[1]} tokens; {n_cells} cells; torch threads {torch.get_num_threads()}"
    )

    timings, results, seconds = {}, {}, {}
    t = time.perf_counter()
    results["tl"] = tl_sweep(model, clean, hooks, args.site, metrics)
    timings["transformer_lens.patching (one forward per cell)"] = time.perf_counter() - t
    for skip in (False, True):
        t = time.perf_counter()
        sw = patch_sweep(
            model,
            clean,
            clean,
            args.site,
            metrics,
            batch_size=args.batch_size,
            corrupt_hooks=hooks,
            progress=False,
            skip_shared=skip,
        )
        label = f"me_interp.patching batched (batch {sw.batch_size}, skip_shared={skip}, {sw.n_forwards} forwards)"
        timings[label] = seconds[skip] = time.perf_counter() - t
        results[skip] = sw.values
    base = timings["transformer_lens.patching (one forward per cell)"]
    for label, secs in timings.items():
        print(f"{secs:8.2f} s  x{base / secs:5.2f}  {label}")
    for skip in (False, True):
        diff = max(
            float((results[skip][k] - results["tl"][k].float()).abs().max()) for k in metrics
        )
        rel = max(
            float(
                (
                    (results[skip][k] - results["tl"][k].float()).abs()
                    / results["tl"][k].float().abs().clamp_min(1e-6)
                ).max()
            )
            for k in metrics
        )
        print(
            f"skip_shared={skip}: max |difference| to transformer_lens = {diff:.3g} (relative {rel:.3g})"
        )
    print(
        f"speed ratio transformer_lens / me_interp, with cell skipping (skip_shared=True): "
        f"{base / seconds[True]:.2f}x"
    )
    print(
        f"speed ratio transformer_lens / me_interp, without cell skipping (skip_shared=False): "
        f"{base / seconds[False]:.2f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
