"""Training-aware WeMask with TRL: a few SFT, DPO or GRPO steps with the mask in place.

Measures the ME layer (or takes ``--me-layer``), builds the TRL trainer from the model's directory,
puts WeMask on every model the trainer runs (:func:`me_interp.training.wemask_training`: the policy,
the reference, generation; the first real token of every row) and trains. Data: the 8 shipped
question/answer pairs (``me_interp/data/finetune_wemask.json``) as prompt/completion pairs (SFT),
with another pair's answer as the rejected completion (DPO), or as prompts rewarded by the share of
the reference answer's words in the completion (GRPO, ties broken by length). It checks and records that

* the mask edited tokens in every masked layer of the policy (and of the reference, if any),
* no hook is left on any model after the run,
* the trained parameters moved (gradients flowed through the masked forward).

    python experiments/train_wemask_trl.py --trainer sft                  # bundled model
    python experiments/train_wemask_trl.py --trainer dpo --lora
    python experiments/train_wemask_trl.py --trainer grpo --model synthetic:planted --me-layer 2

Every run writes ``<out>/train_wemask_trl/<run_id>/``: ``config.json``, ``env.json`` and, last,
``result.json`` (losses, the WeMask spec, edits per model and layer, checks).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from importlib import resources
from pathlib import Path

import torch

from me_interp import io
from me_interp.interventions import WeMask, mask_layers
from me_interp.interventions.wemask import STARTS, VARIANTS, me_layer_index
from me_interp.training import wemask_training

EXPERIMENT = "train_wemask_trl"
TRAINERS = ("sft", "dpo", "grpo")
#: Where the ME layer is measured when ``--me-layer`` is not given (a separate me_interp copy).
SCAN_DEVICE, SCAN_DTYPE = "cpu", "float32"


def load_pairs() -> list[dict]:
    text = resources.files("me_interp.data").joinpath("finetune_wemask.json").read_text("utf-8")
    return json.loads(text)


def datasets_for(kind: str, pairs: list[dict]):
    from datasets import Dataset

    prompts = [f"Question: {p['prompt']}\nAnswer:" for p in pairs]
    answers = [" " + p["response"] for p in pairs]
    if kind == "sft":
        return Dataset.from_dict({"prompt": prompts, "completion": answers})
    if kind == "dpo":
        rejected = answers[1:] + answers[:1]
        return Dataset.from_dict({"prompt": prompts, "chosen": answers, "rejected": rejected})
    return Dataset.from_dict({"prompt": prompts, "answer": answers})


def word_overlap(completions, answer, **_):
    """GRPO reward: the share of the reference answer's words that the completion contains, minus
    ``0.001 ×`` the difference of their character lengths (breaks ties, so that a group of
    completions has a non-zero advantage even when no word matches)."""
    out = []
    for c, a in zip(completions, answer):
        want = set(a.lower().split())
        share = len(want & set(c.lower().split())) / max(1, len(want))
        out.append(share - 0.001 * abs(len(c) - len(a)))
    return out


def model_dir(name: str | None, tmp: Path) -> str:
    """A directory TRL can load the policy (and rebuild a reference) from."""
    from me_interp import models
    from me_interp.interventions import load_hf

    if isinstance(name, str) and name.startswith(models.SYNTHETIC_PREFIX):
        hf, tok = load_hf(name)
        hf.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        return str(tmp)
    return models.local_path(name) or name  # bundled / packaged: the converted cache


def build_trainer(kind: str, path: str, args, out: Path):
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    common = dict(
        output_dir=str(out / "trainer"), max_steps=args.steps, learning_rate=args.lr,
        per_device_train_batch_size=args.batch_size, logging_steps=1, report_to=[],
        save_strategy="no", use_cpu=not torch.cuda.is_available(), seed=args.seed,
        disable_tqdm=True, gradient_checkpointing=args.gradient_checkpointing,
    )  # fmt: skip
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        # every linear layer but the LM head, whatever the projections are called (Phi-3 fuses
        # q/k/v into qkv_proj and gate/up into gate_up_proj)
        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
    data = datasets_for(kind, load_pairs())
    if kind == "sft":
        cfg = SFTConfig(**common)
        return SFTTrainer(model=path, args=cfg, train_dataset=data, processing_class=tok,
                          peft_config=peft_config)  # fmt: skip
    if kind == "dpo":
        cfg = DPOConfig(**common)
        return DPOTrainer(model=path, args=cfg, train_dataset=data, processing_class=tok,
                          peft_config=peft_config)  # fmt: skip
    cfg = GRPOConfig(**common, num_generations=2, max_completion_length=args.max_completion,
                     beta=0.05)  # fmt: skip
    return GRPOTrainer(model=path, reward_funcs=word_overlap, args=cfg, train_dataset=data,
                       processing_class=tok, peft_config=peft_config)  # fmt: skip


def training_env(trainer, model: str | None, me_layer_given: bool) -> dict:
    """What ``env.json`` records about the model: the device and dtype of the policy's parameters
    as the trainer holds them, the trainer's mixed precision, and where the ME layer came from."""
    params = list(trainer.model.parameters())
    trained = [p for p in params if p.requires_grad]
    args = trainer.args
    mixed = (
        "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else None
    )
    return {
        "model": model or "bundled",
        "device": str(params[0].device),
        "trainer_device": str(args.device),
        "dtype": str(params[0].dtype).removeprefix("torch."),
        "trained_dtype": str(trained[0].dtype).removeprefix("torch.") if trained else None,
        "mixed_precision": mixed,
        "me_layer_scan": None if me_layer_given else {"device": SCAN_DEVICE, "dtype": SCAN_DTYPE},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trainer", choices=TRAINERS, default="sft")
    ap.add_argument(
        "--model", default=None, help="omit for the bundled model; synthetic:..., a dir"
    )
    ap.add_argument("--me-layer", type=int, default=None, help="ME layer (default: measured)")
    ap.add_argument("--start", choices=STARTS, default="ge")
    ap.add_argument("--rate", type=float, default=0.1)
    ap.add_argument("--variant", choices=VARIANTS, default="weight")
    ap.add_argument("--lora", action="store_true", help="train a LoRA adapter (peft)")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--max-completion", type=int, default=16, help="GRPO completion tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs", help=f"runs go to <out>/{EXPERIMENT}/<run_id>/")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be >= 1")

    torch.manual_seed(args.seed)
    run_dir = io.new_run_dir(args.out, EXPERIMENT)
    print(f"run directory: {run_dir}")
    io.write_json(run_dir / io.CONFIG_FILE, vars(args))
    if args.me_layer is None:
        from me_interp import load_model

        me = me_layer_index(load_model(args.model, device=SCAN_DEVICE, dtype=SCAN_DTYPE))
    else:
        me = args.me_layer
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(args.trainer, model_dir(args.model, Path(tmp)), args, run_dir)
        io.write_json(
            run_dir / io.ENV_FILE,
            io.environment(
                training_env(trainer, args.model, me_layer_given=args.me_layer is not None),
                script="experiments/train_wemask_trl.py",
            ),
        )
        layers = mask_layers(trainer.model, args.start, me_layer=me)
        spec = WeMask.build(trainer.model, layers, args.rate, args.variant, seed=args.seed)
        before = {
            k: v.detach().clone() for k, v in trainer.model.named_parameters() if v.requires_grad
        }
        with wemask_training(trainer, spec) as wm:
            trainer.train()
    moved = sum(
        not torch.equal(v.detach(), before[k])
        for k, v in trainer.model.named_parameters()
        if k in before
    )
    info = wm.to_dict()
    checks = {
        "mask_active_in_every_masked_layer": all(
            st.get(L, {}).get("edited_tokens", 0) > 0 for st in wm.stats.values() for L in layers
        ),
        "no_hook_left": not wm.active,
        "parameters_moved": moved > 0,
    }
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    result = {
        "trainer": args.trainer,
        "model": args.model or "bundled",
        "me_layer": me,
        "masked_layers": list(layers),
        "lora": args.lora,
        "losses": losses,
        "n_parameters_moved": moved,
        "wemask": info,
        "checks": checks,
    }
    io.write_json(run_dir / io.RESULT_FILE, result)  # last: a run without it is incomplete
    print(
        f"{args.trainer}: ME layer {me}, masked layers {layers[0]}..{layers[-1]}; losses {losses}"
    )
    print(f"reference: {info['reference']}; edits per model and layer: {wm.stats}")
    print(f"results in {run_dir}")
    ok = all(checks.values())
    if not ok:
        print(f"FAILED checks: {[k for k, v in checks.items() if not v]}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
