"""Causal hook factories: positive tests (by the computed amount) and negative tests (rest bit-identical)."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch

from me_interp import claims, names
from me_interp.interventions import causal
from me_interp.models import Batch
from me_interp.probes import Activations, record


@pytest.fixture(scope="module")
def setup(planted):
    model, plant = planted
    batch = model.tokenize(
        ["w1 w2 w3 w4 w5 w6", "w9 w10 w11 w12 w13 w14", "w30 w31 w32 w33 w34 w35"]
    )
    return model, plant, batch


def _capture(model, batch, hook_names, hooks=()):
    """The activations at ``hook_names`` of one plain forward under ``hooks`` (a reference)."""
    store = {}

    def keep(x, hook, key):
        store[key] = x.detach().clone()
        return x

    model.run_with_hooks(batch, [*hooks, *((n, partial(keep, key=n)) for n in hook_names)])
    return store


def _cap(model, batch, name, hooks=()):
    return _capture(model, batch, [name], hooks)[name]


def _others(x, p):
    keep = [t for t in range(x.shape[1]) if t != p]
    return x[:, keep].mean(1)


def _assert_rest_identical(before, after, positions, dims=None):
    mask = torch.ones_like(before, dtype=torch.bool)
    if dims is None:
        mask[:, positions] = False
    else:
        for p in positions:
            mask[:, p, dims] = False
    assert torch.equal(before[mask], after[mask])


def test_set_values_positive_negative_and_idempotent(setup):
    model, plant, batch = setup
    name = names.resid_post(1)
    before = _cap(model, batch, name)
    vals = torch.arange(6, dtype=torch.float32).view(2, 3)
    hooks = causal.set_values(name, [1, 4], vals, dims=[2, 5, 9])
    after = _cap(model, batch, name, hooks)
    for b in range(len(batch)):
        assert torch.equal(after[b, 1, [2, 5, 9]], vals[0])
        assert torch.equal(after[b, 4, [2, 5, 9]], vals[1])
    _assert_rest_identical(before, after, [1, 4], [2, 5, 9])
    # idempotent: applying the hook twice is applying it once
    fn = hooks[0][1]
    assert torch.equal(fn(fn(before, None), None), fn(before, None))
    # the model is not mutated
    again = _cap(model, batch, name)
    assert torch.equal(again, before)


def test_set_values_bad_inputs():
    with pytest.raises(ValueError, match="positions must not be empty"):
        causal.set_values("x", [], torch.zeros(0, 2))
    with pytest.raises(ValueError, match="values must be"):
        causal.set_values("x", [0, 1], torch.zeros(3, 2))
    with pytest.raises(ValueError, match="columns"):
        causal.set_values("x", [0], torch.zeros(1, 3), dims=[1, 2])
    with pytest.raises(ValueError, match="distinct"):
        causal.set_values("x", [0], torch.zeros(1, 2), dims=[1, 1])


def test_acts_reuse_equals_a_fresh_capture(setup):
    model, plant, batch = setup
    L = plant.layer
    acts = Activations(
        model,
        batch,
        [
            names.ffn_out(L),
            names.resid_post(L),
            names.site("ffn_act", L),
            names.site("ffn_normalized", L),
        ],
    )
    record(model, batch, [acts], last_layer=acts.last_layer, max_tokens=None)
    pairs = [
        (causal.remove_massive, dict(site="ffn_out")),
        (causal.patch_across_prompts, {}),
        (causal.cap_ffn_output, {}),
        (causal.normalize_ffn_product, {}),
        (causal.flatten_ffn_norm_gain, {}),
    ]
    name = names.resid_post(model.n_layers - 1)
    for fn, kw in pairs:
        fresh = _cap(model, batch, name, fn(model, batch, L, [0], **kw))
        reused = _cap(model, batch, name, fn(model, batch, L, [0], **kw, acts=acts))
        assert torch.equal(fresh, reused), fn.__name__
    t1 = causal.transplant(model, batch, L, 0, 3, [plant.massive_dim])
    t2 = causal.transplant(model, batch, L, 0, 3, [plant.massive_dim], acts=acts)
    assert torch.equal(t1.component, t2.component)
    with pytest.raises(ValueError, match="rows for a batch"):
        causal.remove_massive(
            model,
            batch,
            L,
            [0],
            site="ffn_out",
            acts={names.ffn_out(L): acts[names.ffn_out(L)][:1]},
        )


def test_per_prompt_values_tile_over_copies_of_the_batch(setup):
    """patch_sweep's layout: a batch of n*B rows is n copies of the B prompts."""
    model, plant, batch = setup
    name = names.resid_post(plant.layer)
    hooks = causal.remove_massive(model, batch, plant.layer, [0], [plant.massive_dim])
    one = _cap(model, batch, name, hooks)
    tiled = Batch(batch.tokens.repeat(3, 1), batch.attention_mask.repeat(3, 1))
    three = _cap(model, tiled, name, hooks)
    torch.testing.assert_close(three, one.repeat(3, 1, 1), rtol=1e-5, atol=1e-5)
    odd = Batch(batch.tokens[:2], batch.attention_mask[:2])
    with pytest.raises(ValueError, match="cannot fill"):
        _cap(model, odd, name, hooks)


def test_prompt_batch_cuts_subsamples_and_counts(planted):
    model, _ = planted
    prompts = [f"w{i} w{i + 1} w{i + 2} w{i + 3} w{i + 4} w{i + 5}" for i in range(10)]
    prompts[3] = "w1"  # BOS + 1 token
    pb = causal.prompt_batch(model, prompts, max_tokens=4, max_prompts=5, min_tokens=3)
    assert pb.n_given == 10 and pb.n_short == 1 and len(pb.indices) == 5
    assert 3 not in pb.indices and pb.indices[0] == 0 and pb.indices[-1] == 9  # spread evenly
    assert pb.batch.tokens.shape == (5, 4) and pb.batch.lengths == [4] * 5
    assert pb.to_dict()["n_prompts"] == 5
    everything = causal.prompt_batch(model, prompts, max_tokens=64)
    assert len(everything.indices) == 10 and everything.n_short == 0
    assert everything.batch.lengths[3] == 2 and max(everything.batch.lengths) == 7
    longer = everything.at_least(3)
    assert len(longer.indices) == 9 and longer.n_short == 1 and 3 not in longer.indices
    assert longer.at_least(3) is longer
    with pytest.raises(claims.NotApplicable, match="no prompt has the 99 tokens"):
        everything.at_least(99)
    with pytest.raises(claims.NotApplicable, match="no prompt has the 50 tokens"):
        causal.prompt_batch(model, prompts, max_tokens=60, min_tokens=50)
    with pytest.raises(ValueError, match="max_tokens"):
        causal.prompt_batch(model, prompts, max_tokens=1)


@pytest.mark.parametrize("fill", ["others_mean", "zero"])
def test_remove_massive_positive_negative(setup, fill):
    model, plant, batch = setup
    L, D = plant.layer, [plant.massive_dim]
    name = names.resid_post(L)
    before = _cap(model, batch, name)
    after = _cap(model, batch, name, causal.remove_massive(model, batch, L, [0], D, fill=fill))
    expect = _others(before, 0)[:, D] if fill == "others_mean" else torch.zeros(len(batch), 1)
    torch.testing.assert_close(after[:, 0, D], expect, rtol=1e-6, atol=1e-6)
    _assert_rest_identical(before, after, [0], D)
    assert before[:, 0, D].abs().min() > 100  # it was massive


def test_remove_massive_shared_values_are_prompt_means(setup):
    model, plant, batch = setup
    name = names.ffn_out(plant.layer)
    before = _cap(model, batch, name)
    hooks = causal.remove_massive(
        model, batch, plant.layer, [0], None, site="ffn_out", per_prompt=False
    )
    after = _cap(model, batch, name, hooks)
    expect = _others(before, 0).mean(0)
    for b in range(len(batch)):
        torch.testing.assert_close(after[b, 0], expect, rtol=1e-5, atol=1e-6)
    _assert_rest_identical(before, after, [0])
    # row-wise: works on a batch of another size
    other = model.tokenize(["w40 w41 w42"])
    out = _cap(model, other, name, hooks)
    torch.testing.assert_close(out[0, 0], expect, rtol=1e-5, atol=1e-6)


def test_ablate_dims_mean_and_zero(setup):
    model, plant, batch = setup
    L, D = plant.layer, [plant.massive_dim, 3]
    name = names.resid_post(L)
    before = _cap(model, batch, name)
    mean = _cap(model, batch, name, causal.ablate_dims(model, batch, L, [0], D, "mean"))
    torch.testing.assert_close(mean[:, 0, D], before[:, 0, D].mean(0).expand(len(batch), -1))
    _assert_rest_identical(before, mean, [0], D)
    zero = _cap(model, batch, name, causal.ablate_dims(model, batch, L, [0], D, "zero"))
    assert torch.all(zero[:, 0, D] == 0)
    _assert_rest_identical(before, zero, [0], D)
    with pytest.raises(ValueError, match="mode"):
        causal.ablate_dims(model, batch, L, [0], D, "median")
    with pytest.raises(ValueError, match="out of range"):
        causal.ablate_dims(model, batch, L, [0], [32])


@pytest.mark.parametrize("remove", [False, True])
def test_transplant_difference(setup, remove):
    model, plant, batch = setup
    L, D = plant.layer, [plant.massive_dim]
    name = names.resid_post(L)
    h = _cap(model, batch, name)
    t = causal.transplant(model, batch, L, 0, 3, D, "difference", remove_source=remove)
    after = _cap(model, batch, name, t.hooks)
    c = np.zeros((len(batch), model.d_model), dtype=np.float32)
    hn = h.numpy()
    c[:, D] = (hn[:, 0] - hn[:, 1:].mean(1))[:, D]
    np.testing.assert_allclose(after[:, 3].numpy(), hn[:, 3] + c, rtol=1e-5, atol=1e-4)
    if remove:
        np.testing.assert_allclose(after[:, 0].numpy(), hn[:, 0] - c, rtol=1e-5, atol=1e-3)
        _assert_rest_identical(h, after, [0, 3])
    else:
        _assert_rest_identical(h, after, [3])


def test_transplant_direction_matches_norm(setup):
    model, plant, batch = setup
    name = names.resid_post(plant.layer)
    h = _cap(model, batch, name)
    t = causal.transplant(model, batch, plant.layer, 0, 2, None, "direction")
    after = _cap(model, batch, name, t.hooks)
    added = after[:, 2] - h[:, 2]
    diff = h[:, 0] - _others(h, 0)
    torch.testing.assert_close(added.norm(dim=-1), diff.norm(dim=-1), rtol=1e-4, atol=1e-3)
    u = added / added.norm(dim=-1, keepdim=True)
    torch.testing.assert_close(u, u[:1].expand_as(u), rtol=1e-4, atol=1e-4)  # one direction
    with pytest.raises(ValueError, match="must differ"):
        causal.transplant(model, batch, plant.layer, 2, 2)
    with pytest.raises(ValueError, match="outside the shortest prompt"):
        causal.transplant(model, batch, plant.layer, 0, 12)


def test_cap_ffn_output(setup):
    model, plant, batch = setup
    name = names.ffn_out(plant.layer)
    x = _cap(model, batch, name)
    after = _cap(model, batch, name, causal.cap_ffn_output(model, batch, plant.layer, [0]))
    med = x[:, 1:].norm(dim=-1).median(dim=-1).values
    torch.testing.assert_close(after[:, 0].norm(dim=-1), med, rtol=1e-5, atol=1e-6)
    cos = torch.nn.functional.cosine_similarity(after[:, 0], x[:, 0], dim=-1)
    torch.testing.assert_close(cos, torch.ones_like(cos), rtol=0, atol=1e-5)
    _assert_rest_identical(x, after, [0])


def test_scale_and_normalize_ffn_product(setup):
    model, plant, batch = setup
    L, name = plant.layer, names.site("ffn_act", plant.layer)
    a = _cap(model, batch, name)
    scaled = _cap(model, batch, name, causal.scale_ffn_product(model, batch, L, [0], 0.25))
    torch.testing.assert_close(scaled[:, 0], 0.25 * a[:, 0])
    _assert_rest_identical(a, scaled, [0])
    normed = _cap(model, batch, name, causal.normalize_ffn_product(model, batch, L, [0]))
    torch.testing.assert_close(
        normed[:, 0].norm(dim=-1), a[:, 1:].norm(dim=-1).mean(-1), rtol=1e-5, atol=1e-6
    )
    _assert_rest_identical(a, normed, [0])


def test_flatten_ffn_norm_gain(setup):
    model, plant, batch = setup
    L = plant.layer
    mid = _cap(model, batch, names.resid_mid(L)).double()
    eps = model.norm_eps()
    hat = mid / torch.sqrt((mid**2).mean(-1, keepdim=True) + eps)
    w = model.ffn_norm_gain(L).detach().double()
    name = names.ffn_in(L)
    before = _cap(model, batch, name)
    after = _cap(model, batch, name, causal.flatten_ffn_norm_gain(model, batch, L, [0]))
    torch.testing.assert_close(after[:, 0].double(), hat[:, 0] * w.mean(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(before[:, 0].double(), hat[:, 0] * w, rtol=1e-5, atol=1e-5)
    _assert_rest_identical(before, after, [0])
    # the planted gain dims were what made the FFN fire: the massive activation is gone
    out = _cap(
        model, batch, names.resid_post(L), causal.flatten_ffn_norm_gain(model, batch, L, [0])
    )
    assert (
        out[:, 0, plant.massive_dim].abs().max()
        < 0.1 * _cap(model, batch, names.resid_post(L))[:, 0, plant.massive_dim].abs().min()
    )


def test_factories_reject_bad_layers_and_positions(setup):
    model, plant, batch = setup
    with pytest.raises(ValueError, match="out of range"):
        causal.cap_ffn_output(model, batch, 5, [0])
    with pytest.raises(ValueError, match="outside the shortest prompt"):
        causal.scale_ffn_product(model, batch, 1, [7], 0.5)
    with pytest.raises(ValueError, match="positions must not be empty"):
        causal.normalize_ffn_product(model, batch, 1, [])
    with pytest.raises(ValueError, match="fill"):
        causal.remove_massive(model, batch, 1, [0], fill="one")
    with pytest.raises(ValueError, match="dims must not be empty"):
        causal.remove_massive(model, batch, 1, [0], dims=[])


def test_patch_across_prompts(setup):
    model, plant, batch = setup
    name = names.resid_post(1)
    before = _cap(model, batch, name)
    after = _cap(model, batch, name, causal.patch_across_prompts(model, batch, 1, [2, 4]))
    for b in range(len(batch)):
        src = (b + 1) % len(batch)
        assert torch.equal(after[b, [2, 4]], before[src, [2, 4]])
    _assert_rest_identical(before, after, [2, 4])
    with pytest.raises(ValueError, match=">= 2 prompts"):
        causal.patch_across_prompts(model, model.tokenize(["w1 w2 w3"]), 1, [0])
    with pytest.raises(ValueError, match="shift"):
        causal.patch_across_prompts(model, batch, 1, [0], shift=3)


def test_set_ffn_own_at_sets_only_its_cells_and_is_idempotent():
    y = torch.randn(3, 5, 4)
    hooks = causal.set_ffn_own_at(2, 1, [0, 3, 2], torch.tensor([7.0, 8.0, 9.0]))
    assert hooks[0][0] == names.ffn_own(2)
    fn = hooks[0][1]
    out = fn(y, None)
    assert out[0, 0, 1] == 7 and out[1, 3, 1] == 8 and out[2, 2, 1] == 9
    mask = torch.ones_like(y, dtype=torch.bool)
    mask[0, 0, 1] = mask[1, 3, 1] = mask[2, 2, 1] = False
    assert torch.equal(out[mask], y[mask])
    assert torch.equal(fn(out, None), out)  # idempotent


def test_set_ffn_own_at_in_a_forward(setup):
    """In a real forward: the FFN's own output of row r at each prompt's position becomes the given
    value (positive); every other cell of that hook and everything before the layer are unchanged
    (negative)."""
    model, plant, batch = setup
    L, r = plant.layer, plant.massive_dim
    name = names.ffn_own(L)
    before = _cap(model, batch, name)
    pos = [0, 2, 1]
    values = torch.tensor([1.5, -2.0, 3.0])
    after = _cap(model, batch, name, causal.set_ffn_own_at(L, r, pos, values))
    got = after[torch.arange(len(batch)), torch.tensor(pos), r]
    torch.testing.assert_close(got, values.to(got.dtype))
    mask = torch.ones_like(before, dtype=torch.bool)
    mask[torch.arange(len(batch)), torch.tensor(pos), r] = False
    assert torch.equal(after[mask], before[mask])
