"""Soft alternatives: h − α P_S h and h − α (⟨h,v⟩/‖v‖²) v, at the attention input or the residual."""

from __future__ import annotations

import pytest
import torch

from me_interp import names, synthetic
from me_interp.interventions import (
    DirectionProjection,
    dim_projection,
    estimate_direction,
    project_dims,
    project_direction,
    tl_hooks,
    we_mask,
)

LAYERS = (2, 3, 4)


@pytest.fixture(scope="module")
def pbatch(planted):
    model, _ = planted
    return model.tokenize([synthetic.words(6, 1), synthetic.words(6, 30)])


def _capture(model, batch, site, layer, hooks=()):
    store = {}

    def rec(x, hook):
        store["x"] = x.detach().clone()
        return x

    logits = model.run_with_hooks(batch, [*hooks, (names.site(site, layer), rec)])
    return logits, store["x"]


def test_alpha_zero_is_bit_identical(planted, pbatch):
    model, _ = planted
    base = model.run_with_hooks(pbatch)
    v = torch.randn(model.d_model)
    for site in ("attn_in", "resid_post"):
        assert torch.equal(
            base, model.run_with_hooks(pbatch, project_dims(model, 0.0, LAYERS, site=site))
        )
        assert torch.equal(
            base, model.run_with_hooks(pbatch, project_direction(model, 0.0, v, LAYERS, site=site))
        )


def test_dim_projection_alpha_one_is_wemask(planted, pbatch):
    model, _ = planted
    a = model.run_with_hooks(pbatch, project_dims(model, 1.0, LAYERS, variant="weight", rate=0.3))
    b = model.run_with_hooks(pbatch, we_mask(model, 0.3, "weight", layers=LAYERS))
    assert torch.equal(a, b)


def test_dim_projection_scales_chosen_dims_by_one_minus_alpha(planted, pbatch):
    model, _ = planted
    L, dims, alpha = 2, [3, 7, 11], 0.4
    _, x0 = _capture(model, pbatch, "attn_in", L)
    _, x1 = _capture(model, pbatch, "attn_in", L, project_dims(model, alpha, [L], dims=dims))
    want = x0.clone()
    want[:, 0, dims] = x0[:, 0, dims] * (1 - alpha)
    assert torch.equal(x1, want)  # everything else bit-identical


def test_direction_projection_removes_alpha_of_the_component(planted, pbatch):
    model, _ = planted
    L, alpha = 3, 0.7
    v = torch.randn(model.d_model)
    _, x0 = _capture(model, pbatch, "attn_in", L)
    _, x1 = _capture(model, pbatch, "attn_in", L, project_direction(model, alpha, {L: v}))
    vh = v / v.norm()
    c0, c1 = x0[:, 0] @ vh, x1[:, 0] @ vh
    torch.testing.assert_close(c1, (1 - alpha) * c0, atol=1e-5, rtol=1e-5)
    perp0 = x0[:, 0] - c0[:, None] * vh
    perp1 = x1[:, 0] - c1[:, None] * vh
    torch.testing.assert_close(perp1, perp0, atol=1e-5, rtol=1e-5)
    assert torch.equal(x0[:, 1:], x1[:, 1:])


def test_resid_site_edits_the_residual_stream(planted, pbatch):
    model, _ = planted
    L = 2
    hooks = project_dims(model, 1.0, [L], dims=[7], site="resid_post")
    _, r_post = _capture(model, pbatch, "resid_post", L, hooks)
    _, r_next = _capture(model, pbatch, "resid_pre", L + 1, hooks)
    assert torch.equal(r_post[:, 0, 7], torch.zeros(2))
    assert torch.equal(r_next[:, 0, 7], torch.zeros(2))  # carried downstream


def test_estimate_direction_is_the_mean_massive_vector(planted, pbatch):
    model, _ = planted
    L = 3
    _, x = _capture(model, pbatch, "attn_in", L)
    v = estimate_direction(model, pbatch, [L], "attn_in")[L]
    torch.testing.assert_close(v, x[:, 0].float().mean(0))


def test_soft_hooks_are_idempotent(planted):
    model, _ = planted
    spec = DirectionProjection.build(model, 0.5, torch.randn(model.d_model), layers=[2])
    fn = dict(tl_hooks(spec))[names.attn_in(2)]
    x = torch.randn(2, 4, model.d_model)
    once = fn(x, None)
    assert torch.equal(fn(once, None), once)
    spec2 = dim_projection(model, 0.5, [2], dims=[1, 2])
    fn2 = dict(tl_hooks(spec2))[names.attn_in(2)]
    once2 = fn2(x, None)
    assert torch.equal(fn2(once2, None), once2)


def test_bad_soft_inputs(planted):
    model, _ = planted
    with pytest.raises(ValueError, match="alpha must be in"):
        project_dims(model, 1.5, LAYERS)
    with pytest.raises(ValueError, match="alpha must be in"):
        project_direction(model, -0.1, torch.ones(model.d_model), LAYERS)
    with pytest.raises(ValueError, match="dims must lie"):
        project_dims(model, 0.5, LAYERS, dims=[model.d_model])
    with pytest.raises(ValueError, match="zero or not finite"):
        project_direction(model, 0.5, torch.zeros(model.d_model), LAYERS)
    with pytest.raises(ValueError, match="dims, the model has"):
        project_direction(model, 0.5, torch.ones(3), LAYERS)
    with pytest.raises(ValueError, match="unknown site"):
        project_dims(model, 0.5, LAYERS, site="mlp")
    with pytest.raises(ValueError, match="no direction given"):
        project_direction(model, 0.5, {2: torch.ones(model.d_model)}, layers=[2, 3])
