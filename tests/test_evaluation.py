"""Evaluation helpers against independent re-derivations (numpy / by hand)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from me_interp import evaluation, synthetic
from me_interp.evaluation import MCItem, agreement, load_mc_items, score_choices
from me_interp.interventions import we_mask


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


def test_mc_items_file_and_errors(tmp_path):
    items = load_mc_items()
    assert len(items) >= 12 and all(len(it.choices) >= 2 for it in items)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"context": "x", "choices": ["a"], "answer": 0}]))
    with pytest.raises(ValueError, match="at least 2 choices"):
        load_mc_items(str(bad))
    bad.write_text(json.dumps([{"context": "x", "choices": ["a", "b"]}]))
    with pytest.raises(ValueError, match="malformed"):
        load_mc_items(str(bad))
    with pytest.raises(ValueError, match="out of range"):
        MCItem("x", ("a", "b"), 2)


def test_bundled_mc_accuracy(bundled):
    """The real model gets most of the shipped easy items right (two-sided bound: not trivially 1)."""
    res = score_choices(bundled, load_mc_items())
    assert 0.75 <= res.accuracy <= 1.0
    assert res.accuracy > 1 / 4 + 0.3  # far above chance (4 choices)
