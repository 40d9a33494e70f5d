"""The whole-tensor recorder: ``record`` with :class:`Activations` gives the activations of a plain
forward (the batch as it is, or in chunks at the real positions), stops after the last block it reads,
and leaves the forward's logits unchanged."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from me_interp import names
from me_interp.probes import Activations, record


def _plain(model, batch, hook_names, hooks=()):
    store = {}

    def keep(x, hook, key):
        store[key] = x.detach().clone()
        return x

    logits = model.run_with_hooks(batch, [*hooks, *((n, partial(keep, key=n)) for n in hook_names)])
    return store, logits


def test_the_batch_as_it_is_equals_a_plain_forward(tiny_nobos, word_prompts):
    model = tiny_nobos
    batch = model.tokenize(word_prompts)
    wanted = [names.ffn_out(0), names.resid_post(1), names.pattern(1)]
    want, _ = _plain(model, batch, wanted)
    acts = Activations(model, batch, wanted)
    assert acts.last_layer == 1
    record(model, batch, [acts], last_layer=acts.last_layer, max_tokens=None)
    assert sorted(acts) == sorted(wanted) and len(acts) == 3
    for n in wanted:
        assert torch.equal(acts[n], want[n])


def test_chunks_give_the_real_positions_and_nan_where_no_chunk_ran(tiny_nobos, word_prompts):
    model = tiny_nobos
    batch = model.tokenize(word_prompts)
    wanted = [names.resid_post(2), names.pattern(0)]
    want, _ = _plain(model, batch, wanted)
    acts = Activations(model, batch, wanted)
    record(model, batch, [acts], max_tokens=8)  # several chunks, rows sorted by length
    T = batch.tokens.shape[1]
    for b, n in enumerate(batch.lengths):
        h, a = acts[wanted[0]][b], acts[wanted[1]][b]
        torch.testing.assert_close(h[:n], want[wanted[0]][b, :n], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(
            a[:, :n, :n], want[wanted[1]][b, :, :n, :n], rtol=1e-5, atol=1e-6
        )
    shortest = min(range(len(batch)), key=lambda r: batch.lengths[r])
    if batch.lengths[shortest] < T:  # the shortest prompt's chunk is narrower than the batch
        assert torch.isnan(acts[wanted[0]][shortest, -1]).all()


def test_under_hooks_and_with_logits(tiny_nobos, word_prompts):
    model = tiny_nobos
    batch = model.tokenize(word_prompts)
    name = names.resid_post(1)

    def zero(x, hook):
        x = x.clone()
        x[:, 0] = 0.0
        return x

    hooks = [(names.resid_post(0), zero)]
    want, want_logits = _plain(model, batch, [name], hooks)
    acts = Activations(model, batch, [name])
    record(model, batch, [acts], fwd_hooks=hooks, last_layer=1)
    assert torch.equal(acts[name], want[name])
    acts = Activations(model, batch, [name])
    logits = record(model, batch, [acts], fwd_hooks=hooks, logits=True)
    assert torch.equal(logits, want_logits) and torch.equal(acts[name], want[name])
    with pytest.raises(ValueError, match="last_layer must be None"):
        record(model, batch, [acts], logits=True, last_layer=1)
    with pytest.raises(ValueError, match="rows/upto"):
        record(model, batch, [acts], max_tokens=None, rows=[0])


def test_names_are_checked(tiny_nobos, word_prompts):
    model = tiny_nobos
    batch = model.tokenize(word_prompts)
    with pytest.raises(ValueError, match="at least one hook"):
        Activations(model, batch, [])
    acts = Activations(model, batch, [names.resid_post(0)])
    with pytest.raises(KeyError, match="has not been recorded"):
        acts[names.resid_post(0)]
    with pytest.raises(KeyError, match="not one of the recorded names"):
        acts[names.resid_post(1)]
    assert names.resid_post(1) not in acts
    assert Activations(model, batch, [names.resid_post(0), "ln_final.hook_in"]).last_layer is None
    with pytest.raises(KeyError, match="does not exist"):  # TransformerLens refuses a typo
        bad = Activations(model, batch, ["blocks.1.hook_nothing_here"])
        record(model, batch, [bad], max_tokens=None)
