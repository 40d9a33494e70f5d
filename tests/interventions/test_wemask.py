"""WeMask (TransformerLens hooks): selection, identity at r=0, r=1, reference forward, locality."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch

from me_interp import names, synthetic
from me_interp.interventions import WeMask, mask_layers, select_dims, tl_hooks, we_mask
from me_interp.interventions.core import n_selected
from me_interp.interventions.wemask import ALL_VARIANTS, n_dims

LAYERS = (2, 3, 4)


def _capture(model, batch, sites, hooks=()):
    store = {}

    def rec(x, hook, key):
        store[key] = x.detach().clone()
        return x

    rec_hooks = [(names.site(s, L), partial(rec, key=(s, L))) for s, L in sites]
    logits = model.run_with_hooks(batch, [*hooks, *rec_hooks])
    return logits, store


@pytest.fixture(scope="module")
def pbatch(planted):
    model, _ = planted
    return model.tokenize([synthetic.words(7, 3), synthetic.words(7, 20)])  # equal lengths


# -- selection -------------------------------------------------------------------------------


def test_k_is_round_rate_times_d():
    assert [n_selected(r, 576) for r in (0, 0.1, 0.3, 0.5, 0.7, 1.0)] == [0, 58, 173, 288, 403, 576]
    assert n_selected(0.5, 5) == 3  # halves round up
    # the released code's rule truncates: int(r * d), float artefacts included
    rates = (0, 0.1, 0.3, 0.5, 0.7, 1.0)
    assert [n_selected(r, 576, "int") for r in rates] == [0, 57, 172, 288, 403, 576]
    assert n_selected(0.29, 100, "int") == int(0.29 * 100) == 28
    with pytest.raises(ValueError, match="count rule"):
        n_selected(0.1, 576, "nearest")


def test_only_the_released_variant_counts_with_int():
    assert n_dims("activation", 0.1, 576) == 57
    for v in ("weight", "random", "magnitude", "activation_per_prompt"):
        assert n_dims(v, 0.1, 576) == 58


def test_weight_dims_are_top_abs_gain(planted):
    model, _ = planted
    for L in LAYERS:
        g = model.attn_norm_gain(L).detach().numpy()
        k = n_selected(0.3, g.size)
        want = sorted(np.argsort(-np.abs(g), kind="stable")[:k].tolist())
        assert select_dims(model, L, "weight", 0.3).tolist() == want


def test_random_dims_are_seeded_and_distinct(planted):
    model, _ = planted
    a = select_dims(model, 2, "random", 0.25, seed=1)
    assert torch.equal(a, select_dims(model, 2, "random", 0.25, seed=1))
    assert not torch.equal(a, select_dims(model, 2, "random", 0.25, seed=2))
    assert not torch.equal(a, select_dims(model, 3, "random", 0.25, seed=1))
    assert len(set(a.tolist())) == a.numel() == 8


def test_per_prompt_and_magnitude_dims_are_top_abs_per_row(planted):
    model, _ = planted
    x = torch.randn(3, model.d_model)
    for v in ("activation_per_prompt", "magnitude"):
        dims = select_dims(model, 2, v, 0.25, activations=x)
        assert dims.shape == (3, 8)
        for row, d in zip(x.numpy(), dims.tolist()):
            assert sorted(d) == sorted(np.argsort(-np.abs(row), kind="stable")[:8].tolist())


def test_activation_dims_are_the_released_rule(planted):
    """The released code: the top int(r·d) dims of the batch mean of |ĥ|, one set for the batch."""
    model, _ = planted
    d = model.d_model
    x = torch.randn(3, d)
    k = int(0.3 * d)
    assert k != n_selected(0.3, d)  # the two rules differ here
    want = sorted(np.argsort(-np.abs(x.numpy()).mean(0), kind="stable")[:k].tolist())
    dims = select_dims(model, 2, "activation", 0.3, activations=x)
    assert dims.tolist() == want  # [k], not one row per prompt
    assert select_dims(model, 2, "activation", 0.3, activations=x[:, None]).tolist() == want


@pytest.mark.parametrize("rate", [-0.1, 1.01, float("nan")])
def test_rate_outside_unit_interval_is_an_error(planted, rate):
    model, _ = planted
    with pytest.raises(ValueError, match="rate must be in"):
        we_mask(model, rate, layers=LAYERS)


def test_bad_inputs_are_clear_errors(planted):
    model, _ = planted
    with pytest.raises(ValueError, match="unknown WeMask variant"):
        we_mask(model, 0.1, "biggest", layers=LAYERS)
    with pytest.raises(ValueError, match="pass activations"):
        select_dims(model, 2, "activation", 0.1)
    with pytest.raises(ValueError, match="out of range"):
        we_mask(model, 0.1, layers=(7,))
    with pytest.raises(ValueError, match="start must be"):
        mask_layers(model, start=">=")
    with pytest.raises(ValueError, match=">= 0"):
        we_mask(model, 0.1, layers=LAYERS, positions=(-1,))
    with pytest.raises(TypeError):
        we_mask(model, "0.1", layers=LAYERS)


def test_mask_layers_from_detected_me_layer(planted):
    model, plant = planted
    n = model.n_layers
    assert mask_layers(model, "ge") == tuple(range(plant.layer, n))
    assert mask_layers(model, "gt") == tuple(range(plant.layer + 1, n))
    assert mask_layers(model, "ge", me_layer=0, end=1) == (0, 1)


# -- identity / full mask / reference forward ------------------------------------------------


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_rate_zero_is_bit_identical(planted, pbatch, variant):
    model, _ = planted
    sites = [("attn_in", L) for L in LAYERS] + [("resid_post", L) for L in LAYERS]
    base, bs = _capture(model, pbatch, sites)
    out, os_ = _capture(model, pbatch, sites, we_mask(model, 0.0, variant, layers=LAYERS))
    assert torch.equal(base, out)
    for key in bs:
        assert torch.equal(bs[key], os_[key])


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_rate_one_equals_zeroing_the_whole_attention_input(planted, pbatch, variant):
    model, _ = planted

    def zero_first(x, hook):
        y = x.clone()
        y[:, 0] = 0.0
        return y

    manual = model.run_with_hooks(pbatch, [(names.attn_in(L), zero_first) for L in LAYERS])
    masked = model.run_with_hooks(pbatch, we_mask(model, 1.0, variant, layers=LAYERS))
    assert torch.equal(manual, masked)
    assert not torch.equal(manual, model.run_with_hooks(pbatch))


def test_weight_variant_equals_zeroed_gain_for_that_token(
    planted, plain_planted, pbatch, ref_forward
):
    """WeMask(weight) == the hand-written forward with the masked gain entries zeroed for token 0."""
    model, _ = planted
    hf, _, _ = plain_planted
    rate = 0.25
    override = {}
    for L in LAYERS:
        g = hf.model.layers[L].input_layernorm.weight.detach().clone()
        g[select_dims(model, L, "weight", rate)] = 0.0
        override[L] = ([0], g)
    ref = ref_forward(hf, pbatch.tokens, override)
    ref_plain = ref_forward(hf, pbatch.tokens)
    masked = model.run_with_hooks(pbatch, we_mask(model, rate, "weight", layers=LAYERS))
    torch.testing.assert_close(ref_plain, model.run_with_hooks(pbatch), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(masked, ref, atol=1e-5, rtol=1e-5)
    assert (masked - ref_plain).abs().max() > 1e-4  # the mask did something


def test_only_the_massive_token_attention_input_changes(planted, pbatch):
    model, _ = planted
    L = LAYERS[0]
    sites = [("attn_in", L), ("resid_pre", L), ("resid_mid", L)]
    _, base = _capture(model, pbatch, sites)
    rate = 0.5
    _, out = _capture(model, pbatch, sites, we_mask(model, rate, "weight", layers=[L]))
    a0, a1 = base[("attn_in", L)], out[("attn_in", L)]
    assert torch.equal(a0[:, 1:], a1[:, 1:])  # other tokens bit-identical
    assert torch.equal(base[("resid_pre", L)], out[("resid_pre", L)])  # residual stream untouched
    dims = select_dims(model, L, "weight", rate)
    keep = torch.ones(model.d_model, dtype=torch.bool)
    keep[dims] = False
    assert torch.equal(a1[:, 0, dims], torch.zeros_like(a1[:, 0, dims]))
    assert torch.equal(a1[:, 0, keep], a0[:, 0, keep])
    # the residual at resid_mid changes only through attention (so the mask reached the attention)
    assert not torch.equal(base[("resid_mid", L)], out[("resid_mid", L)])


def test_per_prompt_positions(planted, pbatch):
    model, _ = planted
    L = 2
    _, base = _capture(model, pbatch, [("attn_in", L)])
    _, out = _capture(
        model, pbatch, [("attn_in", L)], we_mask(model, 1.0, layers=[L], positions=[[0, 3], [5]])
    )
    a0, a1 = base[("attn_in", L)], out[("attn_in", L)]
    changed = (a0 != a1).any(-1)
    want = torch.zeros_like(changed)
    want[0, 0] = want[0, 3] = want[1, 5] = True
    assert torch.equal(changed, want)
    with pytest.raises(ValueError, match="rows"):
        model.run_with_hooks(pbatch, we_mask(model, 1.0, layers=[L], positions=[[0]]))


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_hooks_are_idempotent(planted, variant):
    model, _ = planted
    spec = WeMask.build(model, [2], 0.25, variant)
    hooks = tl_hooks(spec)
    x = torch.randn(2, 5, model.d_model)
    fns = dict(hooks)
    if spec.needs_resid:
        fns[names.resid_pre(2)](x * 3, None)
    fn = fns[names.attn_in(2)]
    once = fn(x, None)
    twice = fn(once, None)
    assert torch.equal(once, twice)
    assert (once != x).any()


def test_hooks_are_removed_after_an_exception(planted, pbatch):
    model, _ = planted
    base = model.run_with_hooks(pbatch)
    with pytest.raises(RuntimeError, match="boom"):
        with model.bridge.hooks(fwd_hooks=we_mask(model, 1.0, layers=LAYERS)):
            raise RuntimeError("boom")
    assert torch.equal(base, model.run_with_hooks(pbatch))


def test_massive_positions_detected_on_planted(planted, planted_prompts):
    from me_interp.interventions import massive_positions

    model, _ = planted
    pos = massive_positions(model, model.tokenize(planted_prompts))
    assert all(p == [0] for p in pos)


def test_positions_massive_uses_detected_positions(planted, pbatch):
    model, _ = planted
    a = model.run_with_hooks(pbatch, we_mask(model, 1.0, positions="massive", batch=pbatch))
    b = model.run_with_hooks(pbatch, we_mask(model, 1.0, positions=(0,), batch=pbatch))
    assert torch.equal(a, b)  # the planted massive token sits at position 0 in every prompt
    with pytest.raises(ValueError, match="pass batch"):
        we_mask(model, 1.0, layers=LAYERS, positions="massive")
    with pytest.raises(ValueError, match="'massive'"):
        we_mask(model, 1.0, layers=LAYERS, positions="all")


def test_activation_masks_one_set_for_the_whole_batch(planted, pbatch):
    """In a forward, `activation` masks the same int(r·d) dims in every prompt's target token: the top
    dims of the batch mean of |ĥ| there (targets at position 3, which differ between the prompts)."""
    model, _ = planted
    L, rate, d = 2, 0.3, model.d_model
    _, base = _capture(model, pbatch, [("attn_in", L)])
    h3 = base[("attn_in", L)][:, 3]  # [batch d]

    def top(x, k):
        return torch.sort(x.abs(), descending=True, stable=True).indices[:k]

    def masked_exactly(variant, dims_of_prompt):
        hooks = we_mask(model, rate, variant, layers=[L], positions=(3,))
        _, out = _capture(model, pbatch, [("attn_in", L)], hooks)
        got = out[("attn_in", L)][:, 3]
        for b in range(len(pbatch)):
            keep = torch.ones(d, dtype=torch.bool)
            keep[dims_of_prompt[b]] = False
            assert torch.equal(got[b, ~keep], torch.zeros(int((~keep).sum())))
            assert torch.equal(got[b, keep], h3[b, keep])

    k = int(rate * d)
    batch_set = top(h3.abs().mean(0), k)
    assert set(top(h3[0], k).tolist()) != set(top(h3[1], k).tolist())  # per prompt they differ
    masked_exactly("activation", [batch_set, batch_set])
    k_pp = n_selected(rate, d)
    masked_exactly("activation_per_prompt", [top(h3[0], k_pp), top(h3[1], k_pp)])
