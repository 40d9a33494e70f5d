"""Training-aware WeMask, the smallest possible example: fine-tune with the mask in place.

Loads a *plain* HF copy of the model (``me_interp.interventions.load_hf``; the TransformerBridge is not
for training), measures the ME layer (or takes ``--me-layer``), registers the WeMask HF hooks on the
pre-attention RMSNorm of layers ``≥ ME`` (``--start gt``: ``> ME``), and runs a few AdamW steps of SFT on
the shipped examples (``me_interp/data/finetune_wemask.json``; loss on the response tokens only). It
checks and records that

* the loss goes down,
* the mask was active in every step (the hooks count the edited tokens: one per example per layer),
* the saved model reloads (``save_pretrained`` → ``from_pretrained``) and gives the same logits under
  the same mask.

    python experiments/finetune_wemask.py --out runs                              # bundled model
    python experiments/finetune_wemask.py --model synthetic:planted --me-layer 2 --steps 3

Every run writes a new directory ``<out>/finetune_wemask/<run_id>/`` (``me_interp.io.new_run_dir``;
earlier runs are never overwritten) and prints it: ``config.json`` (the arguments), ``env.json``,
``model/`` (the fine-tuned model and tokenizer) and, last, ``result.json`` (losses, edits, checks).

The same hooks go into HF ``Trainer`` / TRL ``SFTTrainer`` / ``DPOTrainer`` / ``GRPOTrainer`` unchanged:
see ``docs/wemask.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib import resources
from pathlib import Path

import torch

from me_interp import io
from me_interp.interventions import WeMask, hf_interventions, load_hf, mask_layers
from me_interp.interventions.wemask import STARTS, VARIANTS

DATA = "finetune_wemask.json"
EXPERIMENT = "finetune_wemask"
MODEL_DIR = "model"


def load_examples(path: str | None = None) -> list[dict]:
    text = (
        resources.files("me_interp.data").joinpath(DATA).read_text("utf-8")
        if path is None
        else Path(path).read_text("utf-8")
    )
    data = json.loads(text)
    if (
        not isinstance(data, list)
        or not data
        or not all({"prompt", "response"} <= set(d) for d in data)
    ):
        raise ValueError("a fine-tuning file is a JSON list of {'prompt', 'response'} objects")
    return data


def sft_batch(tok, examples: list[dict]) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``/``attention_mask``/``labels`` (labels −100 outside the response)."""
    rows, labels = [], []
    for ex in examples:
        p = list(tok(f"Question: {ex['prompt']}\nAnswer:")["input_ids"])
        r = list(tok(" " + ex["response"], add_special_tokens=False)["input_ids"])
        if tok.eos_token_id is not None:
            r.append(tok.eos_token_id)
        rows.append(p + r)
        labels.append([-100] * len(p) + r)
    width = max(map(len, rows))
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    ids = torch.full((len(rows), width), pad)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    lab = torch.full((len(rows), width), -100)
    for i, (r, lb) in enumerate(zip(rows, labels)):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
        lab[i, : len(r)] = torch.tensor(lb)
    return {"input_ids": ids, "attention_mask": mask, "labels": lab}


def measure_me_layer(model_name: str | None) -> int:
    from me_interp import load_model
    from me_interp.interventions.wemask import me_layer_index

    return me_layer_index(load_model(model_name, device="cpu", dtype="float32"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model", default=None, help="omit for the bundled model; synthetic:planted, a dir, ..."
    )
    ap.add_argument("--me-layer", type=int, default=None, help="ME layer (default: measured)")
    ap.add_argument("--start", choices=STARTS, default="ge")
    ap.add_argument("--rate", type=float, default=0.1)
    ap.add_argument("--variant", choices=VARIANTS, default="weight")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument(
        "--data", default=None, help="JSON list of {prompt, response}; default: shipped"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--out", default="runs", help=f"runs go to <out>/{EXPERIMENT}/<run_id>/ (default: runs)"
    )
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error("--steps must be >= 2 to see the loss go down")

    torch.manual_seed(args.seed)
    run_dir = io.new_run_dir(args.out, EXPERIMENT)
    print(f"run directory: {run_dir}")
    io.write_json(run_dir / io.CONFIG_FILE, vars(args))
    io.write_json(
        run_dir / io.ENV_FILE,
        io.environment(
            {"model": args.model or "bundled", "dtype": "float32", "device": "cpu"},
            script="experiments/finetune_wemask.py",
        ),
    )
    hf, tok = load_hf(args.model)
    me = args.me_layer if args.me_layer is not None else measure_me_layer(args.model)
    layers = mask_layers(hf, args.start, me_layer=me)
    spec = WeMask.build(hf, layers, args.rate, args.variant, seed=args.seed)
    batch = sft_batch(tok, load_examples(args.data))
    n_ex = batch["input_ids"].shape[0]

    hf.train()
    opt = torch.optim.AdamW(hf.parameters(), lr=args.lr)
    losses, edits = [], []
    with hf_interventions(hf, spec) as handle:
        for _ in range(args.steps):
            before = {L: handle.stats[L]["edited_tokens"] for L in layers}
            loss = hf(**batch).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            edits.append({L: handle.stats[L]["edited_tokens"] - before[L] for L in layers})
        hf.eval()
        with torch.no_grad():
            trained_logits = hf(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
            ).logits
            final_loss = float(hf(**batch).loss)

    model_dir = run_dir / MODEL_DIR
    hf.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    reloaded, _ = load_hf(str(model_dir))
    with torch.no_grad(), hf_interventions(reloaded, spec):
        re_logits = reloaded(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).logits
    real = batch["attention_mask"].bool()
    reload_diff = float((re_logits - trained_logits)[real].abs().max())

    checks = {
        "loss_went_down": final_loss < losses[0],
        "mask_active_every_step": all(e[L] == n_ex for e in edits for L in layers),
        "reloads_identically": reload_diff < 1e-4,
    }
    metrics = {
        "model": args.model or "bundled",
        "me_layer": me,
        "masked_layers": list(layers),
        "wemask": spec.to_dict(),
        "steps": args.steps,
        "lr": args.lr,
        "n_examples": n_ex,
        "losses": losses,
        "final_loss": final_loss,
        "edited_tokens_per_step": edits,
        "reload_max_abs_logit_diff": reload_diff,
        "checks": checks,
    }
    io.write_json(run_dir / io.RESULT_FILE, metrics)  # last: a run without it is incomplete
    print(f"loss per step: {[round(x, 4) for x in losses]} -> {final_loss:.4f}")
    print(
        f"mask edits per step (tokens per layer): {edits[0]} ... (every step: {checks['mask_active_every_step']})"
    )
    print(f"reload max |logit diff|: {reload_diff:.2e}; model saved to {model_dir}")
    print(f"results in {run_dir}")
    ok = all(checks.values())
    if not ok:
        print(f"FAILED checks: {[k for k, v in checks.items() if not v]}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
