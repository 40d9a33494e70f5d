"""Evaluation helpers against independent re-derivations (numpy / by hand)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from me_interp import evaluation, names, synthetic
from me_interp.evaluation import (
    MCItem,
    Reference,
    agreement,
    agreement_to,
    length_batches,
    load_mc_items,
    pooled_perplexity,
    score_choices,
    text_agreement,
    text_nll,
)
from me_interp.interventions import we_mask
from me_interp.probes.batching import capture_prefix


def _np_kl(p_logits, q_logits):
    p = np.exp(p_logits - p_logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    q = np.exp(q_logits - q_logits.max(-1, keepdims=True))
    q /= q.sum(-1, keepdims=True)
    return (p * (np.log(p) - np.log(q))).sum(-1)


def test_agreement_matches_numpy():
    a = torch.randn(2, 5, 11)
    b = a + 0.5 * torch.randn(2, 5, 11)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    ag = agreement(a, b, mask)
    kl = _np_kl(a.double().numpy(), b.double().numpy())[mask.bool().numpy()]
    same = (a.argmax(-1) == b.argmax(-1))[mask.bool()].float().numpy()
    assert ag.kl == pytest.approx(kl.mean(), rel=1e-5)
    assert ag.max_kl == pytest.approx(kl.max(), rel=1e-5)
    assert ag.top1 == pytest.approx(same.mean())
    assert ag.n_positions == 8


def test_agreement_fixed_points_and_errors():
    a = torch.randn(1, 4, 7)
    ag = agreement(a, a.clone(), torch.ones(1, 4, dtype=torch.long))
    assert ag.kl == pytest.approx(0.0, abs=1e-7) and ag.top1 == 1.0
    # ValueError from agreement itself; jaxtyping's TypeCheckError (a TypeError) when checks are on
    with pytest.raises((ValueError, TypeError)):
        agreement(a, torch.randn(1, 3, 7), torch.ones(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="no real positions"):
        agreement(a, a, torch.zeros(1, 4, dtype=torch.long))


def test_text_agreement_pools_to_agreement():
    a = torch.randn(3, 6, 13)
    b = a + 0.7 * torch.randn(3, 6, 13)
    mask = torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]])
    per = text_agreement(a, b, mask)
    assert per.n == [6, 4, 2]
    kl = _np_kl(a.double().numpy(), b.double().numpy())
    for t, n in enumerate(per.n):  # per text, by hand
        assert per.kl[t] == pytest.approx(kl[t, :n].sum(), rel=1e-5)
        assert per.top1[t] == int((a[t, :n].argmax(-1) == b[t, :n].argmax(-1)).sum())
    pooled = agreement(a, b, mask)
    kl_mean, top1 = per.pooled()
    assert kl_mean == pytest.approx(pooled.kl, rel=1e-5) and top1 == pytest.approx(pooled.top1)
    # the cached reference gives the same numbers from log-probabilities
    via_ref = agreement_to(Reference.of(a), torch.log_softmax(b, -1), mask)
    assert via_ref.top1 == per.top1 and via_ref.n == per.n
    np.testing.assert_allclose(via_ref.kl, per.kl, rtol=1e-5, atol=1e-7)
    same = text_agreement(a, a.clone(), mask)
    assert max(abs(k) for k in same.kl) < 1e-5 and same.top1 == same.n


def test_text_nll_pools_to_perplexity(planted):
    model, _ = planted
    texts = synthetic.planted_prompts(5)
    batch = model.tokenize(texts)
    logits = model.run_with_hooks(batch)
    per = text_nll(logits, batch.tokens, batch.attention_mask)
    assert per.n == [n - 1 for n in batch.lengths]
    assert per.perplexity == pytest.approx(evaluation.perplexity(model, texts), rel=1e-6)
    lp = torch.log_softmax(logits.double(), -1)
    for b, n in enumerate(batch.lengths):  # per text, by hand
        want = -sum(float(lp[b, t, batch.tokens[b, t + 1]]) for t in range(n - 1))
        assert per.nll[b] == pytest.approx(want, rel=1e-5)
    normed = text_nll(
        torch.log_softmax(logits, -1), batch.tokens, batch.attention_mask, normalized=True
    )
    np.testing.assert_allclose(normed.nll, per.nll, rtol=1e-6)
    assert pooled_perplexity([2.0, 4.0], [2, 2]) == pytest.approx(math.exp(1.5))
    with pytest.raises(ValueError, match="at least 2 tokens"):
        pooled_perplexity([0.0], [0])


def test_length_batches_cover_every_text_once(planted):
    model, _ = planted
    texts = [synthetic.words(n, start=3 * n) for n in (9, 2, 5, 9, 3, 7, 4)]
    batches = length_batches(model, texts, max_tokens=20)
    seen = [i for idx, _ in batches for i in idx]
    assert sorted(seen) == list(range(len(texts)))
    full = model.tokenize(texts)
    for idx, batch in batches:
        assert len(idx) * batch.tokens.shape[1] <= max(20, batch.tokens.shape[1])
        for row, i in enumerate(idx):
            n = full.lengths[i]
            assert batch.lengths[row] == n
            assert batch.tokens[row, :n].tolist() == full.tokens[i, :n].tolist()
    lengths = [full.lengths[i] for i in seen]
    assert lengths == sorted(lengths)  # grouped by length
    # per-text statistics do not depend on the grouping
    whole = text_nll(model.run_with_hooks(full), full.tokens, full.attention_mask)
    for idx, batch in batches:
        part = text_nll(model.run_with_hooks(batch), batch.tokens, batch.attention_mask)
        for row, i in enumerate(idx):
            assert part.nll[row] == pytest.approx(whole.nll[i], rel=1e-4, abs=1e-4)
    with pytest.raises(ValueError, match="max_tokens"):
        length_batches(model, texts, max_tokens=0)


def test_text_metrics_against_probes_and_pooled_helpers(planted):
    from me_interp.probes import attention_stats
    from me_interp.probes.geometry import effective_rank

    model, _ = planted
    texts = synthetic.planted_prompts(6)
    batch = model.tokenize(texts)
    stats, ref = evaluation.text_metrics(model, batch, [], [3, 4], 4, None)
    assert set(stats) == set(evaluation.TEXT_STATS) and isinstance(ref, Reference)
    st = attention_stats(model, batch)
    # per text: the probe's per-prompt attention to position 0 / entropy, mean over layers and heads
    np.testing.assert_allclose(stats["sink"], st.to_positions[3:5].mean(dim=(0, 2)), rtol=1e-5)
    np.testing.assert_allclose(stats["entropy"], st.entropy[3:5].mean(dim=(0, 2)), rtol=1e-5)
    assert stats["kl"] == [0.0] * len(batch) and stats["top1"] == stats["n_pos"]
    # the effective rank of text 0's token states t >= 1 at layer 4, by hand
    store: dict = {}

    def grab(x, hook):
        store["r"] = x.detach().clone()
        return x

    model.run_with_hooks(batch, [(names.resid_post(4), grab)])
    n = batch.lengths[0]
    assert stats["eff_rank"][0] == pytest.approx(
        effective_rank(store["r"][0, 1:n].float()), rel=1e-5
    )
    # under a mask: pooled metrics equal the one-batch helpers
    hooks = we_mask(model, 1.0, layers=[2, 3, 4])
    masked, none = evaluation.text_metrics(model, batch, hooks, [3, 4], 4, ref)
    assert none is None
    pooled = evaluation.pooled_metrics(masked)
    assert pooled["perplexity"] == pytest.approx(
        evaluation.perplexity(model, batch, hooks), rel=1e-5
    )
    ag = evaluation.next_token_agreement(model, batch, hooks)
    assert pooled["kl"] == pytest.approx(ag.kl, rel=1e-4, abs=1e-6) and pooled[
        "top1"
    ] == pytest.approx(ag.top1)
    assert pooled["sink"] < evaluation.pooled_metrics(stats)["sink"]  # the planted sink reads it


def test_perplexity_matches_manual(planted):
    model, _ = planted
    texts = synthetic.planted_prompts(3)
    batch = model.tokenize(texts)
    logits = model.run_with_hooks(batch).double()
    nlls = []
    for b, n in enumerate(batch.lengths):
        lp = torch.log_softmax(logits[b, : n - 1], -1)
        nlls += [-float(lp[t, batch.tokens[b, t + 1]]) for t in range(n - 1)]
    assert evaluation.perplexity(model, texts) == pytest.approx(math.exp(np.mean(nlls)), rel=1e-5)


def test_next_token_agreement_under_hooks(planted):
    model, _ = planted
    batch = model.tokenize(synthetic.planted_prompts(3))
    none = evaluation.next_token_agreement(model, batch, [])
    assert none.kl == 0.0 and none.top1 == 1.0
    hooks = we_mask(model, 1.0, layers=[2, 3, 4])
    ag = evaluation.next_token_agreement(model, batch, hooks)
    want = agreement(
        model.run_with_hooks(batch), model.run_with_hooks(batch, hooks), batch.attention_mask
    )
    assert ag == want and ag.kl > 0


def test_score_choices_matches_manual(planted):
    model, _ = planted
    items = [
        MCItem("w1 w2 w3", (" w4", " w9 w10", " w30"), 1),
        MCItem("w7 w8", (" w9", " w50"), 0),
    ]
    res = score_choices(model, items, batch_size=3)  # batches split across items
    for i, it in enumerate(items):
        for c, choice in enumerate(it.choices):
            ctx = model.tokenize(it.context).tokens[0].tolist()
            cont = model.tokenizer(choice, add_special_tokens=False)["input_ids"]
            ids = torch.tensor([ctx + cont])
            logp = torch.log_softmax(
                model.run_with_hooks(model.batch_from_ids(ids.tolist())).double(), -1
            )[0]
            want = sum(float(logp[len(ctx) + j - 1, t]) for j, t in enumerate(cont))
            assert res.loglik[i][c] == pytest.approx(want, rel=1e-4, abs=1e-4)
            assert res.n_tokens[i][c] == len(cont)
    preds = [int(np.argmax(ll)) for ll in res.loglik]
    assert res.predictions == preds
    assert res.accuracy == np.mean([p == it.answer for p, it in zip(preds, items)])
    assert res.correct == [p == it.answer for p, it in zip(preds, items)]
    norm = [int(np.argmax(np.array(ll) / np.array(n))) for ll, n in zip(res.loglik, res.n_tokens)]
    assert res.predictions_norm == norm
    assert res.accuracy_norm == np.mean(res.correct_norm)
    assert res.to_dict()["correct"] == res.correct


def test_mc_items_file_and_errors(tmp_path):
    items = load_mc_items()
    assert len(items) >= 60 and all(len(it.choices) >= 2 for it in items)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"context": "x", "choices": ["a"], "answer": 0}]))
    with pytest.raises(ValueError, match="at least 2 choices"):
        load_mc_items(str(bad))
    bad.write_text(json.dumps([{"context": "x", "choices": ["a", "b"]}]))
    with pytest.raises(ValueError, match="malformed"):
        load_mc_items(str(bad))
    with pytest.raises(ValueError, match="out of range"):
        MCItem("x", ("a", "b"), 2)


@pytest.mark.slow
def test_bundled_mc_accuracy(bundled):
    """The real model gets most of the shipped items right, but not all (two-sided bound)."""
    items = load_mc_items()
    res = score_choices(bundled, items)
    assert 0.7 <= res.accuracy <= 0.95
    chance = np.mean([1 / len(it.choices) for it in items])
    assert res.accuracy > chance + 0.3  # far above chance


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3", "gemma2", "gemma3"])
def test_text_metrics_from_a_prefix_equal_the_full_forward(arch):
    """A masked run from the unmasked inputs of its first masked block gives the per-text statistics
    and the reference distributions of the full forward (rotary embeddings, sliding windows, the
    final soft-cap of Gemma 2)."""
    from me_interp import load_model

    model = load_model(f"synthetic:planted-{arch}")
    batch = model.tokenize(synthetic.planted_prompts(5))
    last = model.n_layers - 1
    layers = list(range(2, model.n_layers))
    stats, ref = evaluation.text_metrics(model, batch, [], layers, last, None)
    inputs = capture_prefix(model, batch, [2], max_tokens=None)
    assert inputs.why is None
    same, ref2 = evaluation.text_metrics(model, batch, [], layers, last, None, inputs, 2)
    torch.testing.assert_close(ref2.probs, ref.probs, rtol=1e-5, atol=1e-6)
    hooks = we_mask(model, 0.5, layers=layers)
    full, _ = evaluation.text_metrics(model, batch, hooks, layers, last, ref)
    part, _ = evaluation.text_metrics(model, batch, hooks, layers, last, ref, inputs, 2)
    for k in evaluation.TEXT_STATS:
        np.testing.assert_allclose(same[k], stats[k], rtol=1e-5, atol=1e-7, err_msg=k)
        np.testing.assert_allclose(part[k], full[k], rtol=1e-5, atol=1e-7, err_msg=k)
    assert full["kl"] != stats["kl"]  # the mask moved something: the equality is not vacuous
    with pytest.raises(ValueError, match="records nothing of layers 1"):
        evaluation.text_metrics(model, batch, hooks, [1, 2], last, ref, inputs, 2)
    early = we_mask(model, 0.5, layers=[1, 2])
    with pytest.raises(ValueError, match="cannot apply hooks before it"):
        evaluation.text_metrics(model, batch, early, layers, last, ref, inputs, 2)
