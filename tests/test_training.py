"""Training-aware WeMask in TRL trainers (me_interp.training): 2-step SFT, DPO and GRPO runs on a
tiny Llama, with every edit checked against the first real token of its row."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("peft")

from datasets import Dataset  # noqa: E402
from peft import LoraConfig  # noqa: E402
from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer  # noqa: E402

from me_interp import synthetic  # noqa: E402
from me_interp.interventions import WeMask  # noqa: E402
from me_interp.training import WeMaskTraining, train_with_wemask, wemask_training  # noqa: E402

LAYERS = (1, 2, 3)


class Recorder:
    """A spec that delegates to a WeMask spec and checks every edit it is asked for.

    During a forward exactly one handle has recorded the positions of this layer's call (and the 2-D
    attention mask, when the forward got one); the expected target is the first real token of each
    row, computed here from the mask, if it lies in this call (``first >= past``). A call outside
    the layer's own hooks is a gradient-checkpoint recompute.
    """

    def __init__(self, spec: WeMask) -> None:
        self.spec = spec
        self.run: WeMaskTraining | None = None
        self.phase = "forward"
        self.calls: list[dict] = []

    def __getattr__(self, name):
        return getattr(self.spec, name)

    def edit(self, h, layer, target, resid):
        live = [k for k, hd in self.run.handles.items() if hd._positions.get(layer) is not None]
        rec = {
            "layer": layer,
            "grad": torch.is_grad_enabled(),
            "requires_grad": h.requires_grad,
            "n": int(target.sum()),
            "phase": self.phase,
        }
        if not live:  # outside the layer's own hooks: a gradient-checkpoint recompute
            rec["role"] = "recompute"
        else:
            assert len(live) == 1
            hd = self.run.handles[live[0]]
            B, T = target.shape
            mask = hd._mask2d
            if mask is None:  # no padding mask given: every row is real from index 0
                past = int(hd._positions[layer][0, 0])
                mask = torch.ones(B, past + T, dtype=torch.long)
            past = mask.shape[1] - T
            first = mask.long().argmax(-1)  # the first real token of each row
            expected = torch.zeros(B, T, dtype=torch.bool)
            for b in range(B):
                if first[b] >= past:
                    expected[b, first[b] - past] = True
            assert torch.equal(target.cpu(), expected), (target, expected, mask)
            rec |= {"role": live[0], "past": past, "left_padded": bool((first > 0).any())}
        self.calls.append(rec)
        return self.spec.edit(h, layer, target, resid)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.manual_seed(0)
    hf, tok = synthetic.tiny_llama(4, add_bos=False)
    d = tmp_path_factory.mktemp("tiny")
    hf.save_pretrained(d)
    tok.save_pretrained(d)
    return str(d), tok


def _args(cfg, tmp_path, batch=2, **kw):
    return cfg(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=batch, report_to=[],
        save_strategy="no", use_cpu=True, learning_rate=1e-2, disable_tqdm=True, **kw,
    )  # fmt: skip


def _n_hooks(model) -> int:
    """Forward hooks and pre-hooks of me_interp's HF interventions on ``model``."""
    from me_interp.interventions.hf_hooks import HFInterventions

    def ours(fn) -> bool:
        return isinstance(getattr(getattr(fn, "func", fn), "__self__", None), HFInterventions)

    return sum(
        ours(fn)
        for m in model.modules()
        for fn in (*m._forward_hooks.values(), *m._forward_pre_hooks.values())
    )


def _run(trainer):
    rec = Recorder(WeMask.build(trainer.model, LAYERS, 0.5, "weight"))
    models = [trainer.model] + ([trainer.ref_model] if getattr(trainer, "ref_model", None) else [])
    before_hooks = [_n_hooks(m) for m in models]
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters() if v.requires_grad}
    wm = wemask_training(trainer, rec)
    rec.run = wm
    with wm:
        during = [_n_hooks(m) for m in models]
        assert all(a > b for a, b in zip(during, before_hooks, strict=True))
        trainer.train()
    assert not wm.active
    assert [_n_hooks(m) for m in models] == before_hooks == [0] * len(models)  # none left
    changed = [k for k, v in trainer.model.named_parameters() if k in before and
               not torch.equal(v.detach(), before[k])]  # fmt: skip
    assert changed, "no trained parameter moved: no gradient reached them"
    return wm, rec, changed


class LeftPadding:
    """TRL's SFT collator (which pads right) with every row turned into a left-padded one: each
    row's tokens, labels and mask are rolled right by its number of pad slots."""

    def __init__(self, pad_token_id: int) -> None:
        from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

        self.right = DataCollatorForLanguageModeling(pad_token_id=pad_token_id)

    def __call__(self, examples):
        out = self.right(examples)
        mask = out["attention_mask"]
        for b in range(mask.shape[0]):
            shift = int((mask[b] == 0).sum())
            for key in ("input_ids", "labels", "attention_mask"):
                out[key][b] = out[key][b].roll(shift)
        return out


def test_left_padding_collator():
    out = LeftPadding(0)([{"input_ids": [5, 6, 7]}, {"input_ids": [8]}])
    assert out["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert out["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert out["labels"].tolist() == [[5, 6, 7], [-100, -100, 8]]


def test_sft_left_padding_gradient_checkpointing(tiny_dir, tmp_path):
    """SFT with left-padded batches (TRL's collator pads right, so the test's collator pads left)
    and gradient checkpointing: every forward edits each row's first real token only."""
    path, tok = tiny_dir
    texts = Dataset.from_dict({"text": ["w1 w2 w3 w4 w5", "w6 w7", "w8 w9 w10", "w11 w12 w13"]})
    tr = SFTTrainer(
        model=path, args=_args(SFTConfig, tmp_path, gradient_checkpointing=True),
        train_dataset=texts, processing_class=tok, data_collator=LeftPadding(tok.pad_token_id),
    )  # fmt: skip
    wm, rec, _ = _run(tr)
    fwd = [c for c in rec.calls if c["role"] == "policy"]
    # the Recorder checked each edit against the mask; some rows did not start at index 0
    assert any(c["left_padded"] for c in fwd)
    again = [c for c in rec.calls if c["role"] == "recompute"]
    assert len(fwd) == 2 * len(LAYERS) and all(c["grad"] and c["requires_grad"] for c in fwd)
    assert all(c["n"] == 2 for c in fwd)  # one token per row per masked layer
    # gradient checkpointing: each layer re-runs in the backward and edits the same tokens
    assert sorted((c["layer"], c["n"]) for c in again) == sorted((c["layer"], c["n"]) for c in fwd)
    assert wm.stats["policy"][1] == {"calls": 4, "edited_tokens": 8}


def test_dpo_lora_reference_is_masked(tiny_dir, tmp_path):
    path, tok = tiny_dir
    pairs = Dataset.from_dict({
        "prompt": ["w1 w2", "w3 w4 w5 w6"], "chosen": [" w7 w8", " w9"],
        "rejected": [" w10", " w11 w12 w13"],
    })  # fmt: skip
    tr = DPOTrainer(
        model=path, args=_args(DPOConfig, tmp_path), train_dataset=pairs, processing_class=tok,
        peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
    )  # fmt: skip
    assert tr.ref_model is None
    wm, rec, changed = _run(tr)
    assert wm.reference == "policy" and set(wm.handles) == {"policy"}
    assert changed and all("lora" in k for k in changed)
    policy = [c for c in rec.calls if c["grad"]]
    ref = [c for c in rec.calls if not c["grad"]]  # the adapter-disabled reference, under no_grad
    assert len(ref) == 2 * len(LAYERS)  # one reference forward per step and layer
    assert len(policy) >= 2 * len(LAYERS)
    assert all(c["requires_grad"] for c in policy)
    assert all(c["n"] == 4 for c in policy + ref)  # [chosen; rejected] x 2 pairs, one each


def test_grpo_full_reference_and_generation(tiny_dir, tmp_path):
    path, tok = tiny_dir
    prompts = Dataset.from_dict({"prompt": ["w1 w2 w3", "w4", "w5 w6", "w7 w8 w9 w10"]})

    def reward(completions, **kw):
        return [float(len(c)) for c in completions]

    tr = GRPOTrainer(
        model=path, reward_funcs=reward, train_dataset=prompts, processing_class=tok,
        args=_args(GRPOConfig, tmp_path, batch=4, num_generations=2, max_completion_length=4,
                   beta=0.1),
    )  # fmt: skip
    assert tr.ref_model is not None  # rebuilt by TRL from the checkpoint, without hooks
    gen = tr.model.generate
    rec_box: list[Recorder] = []

    def generate(*a, **kw):
        rec_box[0].phase = "generate"
        try:
            return gen(*a, **kw)
        finally:
            rec_box[0].phase = "forward"

    tr.model.generate = generate
    orig_build = WeMask.build

    rec = Recorder(orig_build(tr.model, LAYERS, 0.5, "weight"))
    rec_box.append(rec)
    wm = wemask_training(tr, rec)
    rec.run = wm
    with wm:
        tr.train()
    assert not wm.active and set(wm.handles) == {"policy", "ref_model"}
    assert wm.reference == "ref_model"
    g = [c for c in rec.calls if c["phase"] == "generate"]
    assert any(c["past"] == 0 and c["n"] > 0 and c["left_padded"] for c in g)  # prefill
    assert any(c["past"] > 0 for c in g) and all(c["n"] == 0 for c in g if c["past"] > 0)
    ref = [c for c in rec.calls if c["role"] == "ref_model"]
    assert ref and all(c["n"] > 0 and not c["grad"] for c in ref)
    train = [c for c in rec.calls if c["role"] == "policy" and c["grad"]]
    assert train and all(c["requires_grad"] for c in train)
    assert any(c["left_padded"] for c in train)  # left-padded prompts: first token not index 0


def test_train_with_wemask_reports(tiny_dir, tmp_path):
    path, tok = tiny_dir
    texts = Dataset.from_dict({"text": ["w1 w2 w3", "w4 w5"]})
    tr = SFTTrainer(model=path, args=_args(SFTConfig, tmp_path, gradient_checkpointing=False),
                    train_dataset=texts,
                    processing_class=tok)  # fmt: skip
    spec = WeMask.build(tr.model, LAYERS, 0.5, "weight")
    out, info = train_with_wemask(tr, spec)
    assert out.global_step == 2
    assert info["reference"] == "none" and info["specs"][0]["layers"] == list(LAYERS)
    assert info["stats"]["policy"]["2"] == {"calls": 2, "edited_tokens": 4}


@pytest.mark.parametrize(
    "flag", ["use_vllm", "use_transformers_continuous_batching", "precompute_ref_log_probs"]
)
def test_refuses_unmaskable_setups(flag):
    hf, _ = synthetic.tiny_llama(4)
    spec = WeMask.build(hf, LAYERS, 0.5)
    trainer = SimpleNamespace(model=hf, args=SimpleNamespace(**{flag: True}))
    with pytest.raises(ValueError, match=flag):
        wemask_training(trainer, spec)
    ok = SimpleNamespace(model=hf, args=SimpleNamespace(**{flag: False}))
    assert not wemask_training(ok, spec).active


def test_needs_a_spec():
    hf, _ = synthetic.tiny_llama(4)
    with pytest.raises(ValueError, match="at least one"):
        wemask_training(SimpleNamespace(model=hf, args=None))


@pytest.fixture(scope="module")
def script():
    """experiments/train_wemask_trl.py as a module."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "experiments" / "train_wemask_trl.py"
    spec = importlib.util.spec_from_file_location("train_wemask_trl", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("kind, extra", [("sft", []), ("dpo", ["--lora"]), ("grpo", [])])
def test_example_script(script, kind, extra, tmp_path, capsys):
    import json
    from pathlib import Path

    args = ["--trainer", kind, "--model", "synthetic:planted", "--me-layer", "2", "--steps", "2",
            "--lr", "1e-2", "--batch-size", "4", "--max-completion", "3", "--out", str(tmp_path),
            *extra]  # fmt: skip
    assert script.main(args) == 0
    run_dir = Path(capsys.readouterr().out.split("results in ")[1].strip())
    assert run_dir.parent == tmp_path / "train_wemask_trl"
    assert {p.name for p in run_dir.iterdir()} >= {"config.json", "env.json", "result.json"}
    env = json.loads((run_dir / "env.json").read_text())
    assert env["device"] == env["trainer_device"] == "cpu" and env["dtype"] == "float32"
    assert env["me_layer_scan"] is None  # --me-layer given
    res = json.loads((run_dir / "result.json").read_text())
    assert all(res["checks"].values()) and res["masked_layers"] == [2, 3, 4]
    assert len(res["losses"]) == 2
    assert res["wemask"]["reference"] == {"sft": "none", "dpo": "policy", "grpo": "ref_model"}[kind]


def test_script_env_records_the_trainer_model(script):
    """env.json's device and dtype are read from the model the trainer holds (a bf16 model on the
    CPU here, not the float32 the script used to write for every run) and its mixed precision."""
    hf, _ = synthetic.tiny_llama(2)
    hf = hf.to(torch.bfloat16)
    hf.model.embed_tokens.weight.requires_grad_(False)
    args = SimpleNamespace(device=torch.device("cpu"), bf16=False, fp16=True)
    env = script.training_env(SimpleNamespace(model=hf, args=args), None, me_layer_given=False)
    assert env == {
        "model": "bundled", "device": "cpu", "trainer_device": "cpu", "dtype": "bfloat16",
        "trained_dtype": "bfloat16", "mixed_precision": "fp16",
        "me_layer_scan": {"device": script.SCAN_DEVICE, "dtype": script.SCAN_DTYPE},
    }  # fmt: skip


def test_script_lora_targets_fused_projections(script, tmp_path):
    """--lora on a Phi-3 (fused qkv_proj / gate_up_proj, no q_proj / v_proj): adapters on every
    linear layer of the blocks, none on the LM head (before: peft found no target module)."""
    hf, tok = synthetic.tiny("phi3", n_layers=2)
    hf.save_pretrained(tmp_path / "phi3")
    tok.save_pretrained(tmp_path / "phi3")
    args = SimpleNamespace(steps=1, lr=1e-3, batch_size=2, seed=0, gradient_checkpointing=False,
                           lora=True, max_completion=4)  # fmt: skip
    tr = script.build_trainer("sft", str(tmp_path / "phi3"), args, tmp_path)
    adapted = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in tr.model.named_parameters()
               if ".lora_A" in n}  # fmt: skip
    assert adapted == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}


def test_script_model_dir_packaged(script, tmp_path, monkeypatch):
    """A packaged model's short name goes to TRL as its cache directory (before: passed on as a hub
    name, OSError); the cache function is replaced by one returning a fixed path."""
    from me_interp.loading import packaged  # where local_path looks the cache up

    monkeypatch.setattr(packaged, "ensure_packaged_cache", lambda name, rebuild=False: tmp_path)
    assert script.model_dir("gemma-3-270m", tmp_path / "unused") == str(tmp_path)
    assert script.model_dir("some/hub-name", tmp_path / "unused") == "some/hub-name"


@pytest.mark.parametrize("mode", ["absolute", "mask"])
def test_gradient_checkpointing_same_gradients(mode):
    """With gradient checkpointing the recompute edits the same tokens: the gradients equal those of
    a run without checkpointing (before, the HF hooks raised in the recompute)."""
    from me_interp.interventions import hf_interventions

    hf, tok = synthetic.tiny_llama(4)
    tok.padding_side = "left"
    b = tok(["w1 w2 w3 w4", "w5 w6"], return_tensors="pt", padding=True)
    spec = WeMask.build(hf, LAYERS, 0.5)
    grads = []
    for gc in (False, True):
        hf.zero_grad()
        hf.train()
        if gc:
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        with hf_interventions(hf, spec, positions_from=mode) as h:
            hf(**b, labels=b["input_ids"]).loss.backward()
        assert h.stats[1]["calls"] == (2 if gc else 1)
        grads.append([p.grad.clone() for p in hf.parameters()])
    hf.gradient_checkpointing_disable()
    for g0, g1 in zip(*grads):
        torch.testing.assert_close(g0, g1, atol=1e-6, rtol=1e-5)
