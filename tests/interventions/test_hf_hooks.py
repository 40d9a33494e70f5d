"""HF forward hooks: identical to the TransformerLens hooks, gradients flow, cleaned up."""

from __future__ import annotations

import pytest
import torch

from me_interp import synthetic
from me_interp.interventions import (
    DirectionProjection,
    WeMask,
    dim_projection,
    hf_interventions,
    hf_we_mask,
    tl_hooks,
)
from me_interp.interventions.wemask import ALL_VARIANTS

LAYERS = (2, 3, 4)


def _hf_logits(hf, batch, *specs, **kw):
    with torch.no_grad(), hf_interventions(hf, *specs, **kw):
        return hf(batch.tokens, attention_mask=batch.attention_mask).logits


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_hf_equals_tl_on_planted(planted, plain_planted, variant):
    model, _ = planted
    hf, _, _ = plain_planted
    batch = model.tokenize(synthetic.planted_prompts(4))
    spec = WeMask.build(model, LAYERS, 0.3, variant, seed=3)
    tl = model.run_with_hooks(batch, tl_hooks(spec))
    hfl = _hf_logits(hf, batch, spec)
    real = batch.attention_mask.bool()
    torch.testing.assert_close(hfl[real], tl[real], atol=1e-5, rtol=1e-5)
    assert (tl - model.run_with_hooks(batch))[real].abs().max() > 1e-5


def test_hf_soft_equals_tl(planted, plain_planted):
    model, _ = planted
    hf, _, _ = plain_planted
    batch = model.tokenize(synthetic.planted_prompts(3))
    real = batch.attention_mask.bool()
    for spec in (
        dim_projection(model, 0.6, [2, 3], dims=[7, 3], site="resid_post"),
        DirectionProjection.build(model, 0.8, torch.randn(model.d_model), layers=LAYERS),
    ):
        torch.testing.assert_close(
            _hf_logits(hf, batch, spec)[real],
            model.run_with_hooks(batch, tl_hooks(spec))[real],
            atol=1e-5,
            rtol=1e-5,
        )


def test_hf_equals_tl_on_bundled(bundled, plain_bundled):
    hf, _ = plain_bundled
    batch = bundled.tokenize(["The capital of France is Paris.", "Once upon a time, a fox"])
    real = batch.attention_mask.bool()
    layers = tuple(range(11, bundled.n_layers))  # measured ME layer of the bundled model: 11
    for variant in ("weight", "magnitude"):
        spec = WeMask.build(bundled, layers, 0.1, variant)
        tl = bundled.run_with_hooks(batch, tl_hooks(spec))
        torch.testing.assert_close(
            _hf_logits(hf, batch, spec)[real], tl[real], atol=1e-5, rtol=1e-5
        )


def test_gradients_flow_and_masked_entries_get_none(plain_tiny):
    hf, tok = plain_tiny
    hf = hf.train()
    ids = torch.tensor([tok("w1 w2 w3 w4 w5 w6")["input_ids"]])
    L, rate = 1, 0.25
    spec = WeMask.build(hf, [L], rate, "weight")
    dims = spec.fixed_dims[L]
    seen = {}

    def keep_grad(mod, args, out):  # registered first: sees the pre-mask norm output
        out.retain_grad()
        seen["pre"] = out

    h = hf.model.layers[L].input_layernorm.register_forward_hook(keep_grad)
    try:
        with hf_interventions(hf, spec) as handle:
            loss = hf(ids, labels=ids).loss
            loss.backward()
        assert handle.stats[L] == {"calls": 1, "edited_tokens": 1}
    finally:
        h.remove()
        hf.eval()
    g = seen["pre"].grad
    assert torch.isfinite(g).all()
    assert torch.equal(g[0, 0, dims], torch.zeros_like(g[0, 0, dims]))  # masked: no gradient
    keep = torch.ones(g.shape[-1], dtype=torch.bool)
    keep[dims] = False
    assert g[0, 0, keep].abs().sum() > 0 and g[0, 1:].abs().sum() > 0
    grads = [p.grad for p in hf.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(x).all() for x in grads)
    hf.zero_grad(set_to_none=True)


def test_hooks_removed_after_exception(plain_planted):
    hf, _, _ = plain_planted
    handle = hf_we_mask(hf, 0.5, layers=LAYERS)
    with pytest.raises(RuntimeError, match="boom"):
        with handle:
            assert handle.active
            raise RuntimeError("boom")
    assert not handle.active
    for layer in hf.model.layers:
        assert not layer._forward_hooks and not layer._forward_pre_hooks
        assert not layer.input_layernorm._forward_hooks


def test_bad_hf_inputs(plain_planted):
    hf, _, _ = plain_planted
    with pytest.raises(ValueError, match="out of range"):
        hf_we_mask(hf, 0.5, layers=[9])
    with pytest.raises(ValueError, match="positions_from"):
        hf_interventions(hf, WeMask.build(hf, [1], 0.5), positions_from="relative")
    with pytest.raises(ValueError, match="at least one"):
        hf_interventions(hf)


def test_edit_without_recorded_positions_raises(plain_planted):
    """A norm run outside its decoder layer has no recorded positions: the hook must not assume
    arange(T) (the released code's KV-cache bug) but raise."""
    hf, _, _ = plain_planted
    norm = hf.model.layers[LAYERS[0]].input_layernorm
    x = torch.randn(1, 3, hf.config.hidden_size)
    with torch.no_grad(), hf_we_mask(hf, 0.5, layers=LAYERS):
        with pytest.raises(RuntimeError, match="positions"):
            norm(x)
        hf(torch.tensor([[1, 5, 6]]))  # inside the decoder layer: fine
    with hf_we_mask(hf, 0.5, layers=LAYERS) as handle:
        handle._positions[LAYERS[0]] = torch.arange(2)[None]  # left over from a 2-token call
        with pytest.raises(RuntimeError, match="positions for 2 tokens"):
            handle._edit(norm, (x,), x, L=LAYERS[0], spec=handle.specs[0])


def test_loaded_model_hooks_sit_on_its_attn_norm_module(planted):
    """On a LoadedModel the attn_in hook goes on ``model.attn_norm_module(L)`` (the Architecture's
    module, not a name looked up on the HF layer) and the logits equal the TransformerLens hooks'."""
    model, _ = planted
    batch = model.tokenize(synthetic.planted_prompts(3))
    spec = WeMask.build(model, LAYERS, 0.3, "weight")
    with torch.no_grad(), hf_interventions(model, spec):
        assert all(model.attn_norm_module(L)._forward_hooks for L in LAYERS)
        hfl = model.hf(batch.tokens, attention_mask=batch.attention_mask).logits
    assert not any(model.attn_norm_module(L)._forward_hooks for L in LAYERS)
    real = batch.attention_mask.bool()
    tl = model.run_with_hooks(batch, tl_hooks(spec))
    torch.testing.assert_close(hfl[real], tl[real], atol=1e-5, rtol=1e-5)
    assert (tl - model.run_with_hooks(batch))[real].abs().max() > 1e-5


def test_hf_attn_norm_names_the_module_once(plain_planted):
    from me_interp.architecture import ArchitectureError, hf_attn_norm
    from me_interp.interventions import core

    hf, _, _ = plain_planted
    assert core.attn_norm(hf, 1) is hf_attn_norm(hf.model.layers[1])
    assert hf_attn_norm(hf.model.layers[1]) is hf.model.layers[1].input_layernorm
    with pytest.raises(ArchitectureError, match="pre-attention norm"):
        hf_attn_norm(torch.nn.Linear(2, 2))


@pytest.fixture(scope="module")
def plain_gemma3():
    hf, tok = synthetic.tiny("gemma3")
    return hf.eval(), tok


def test_mask_positions_on_gemma3(plain_gemma3):
    """positions_from='mask' on a Gemma-3 decoder (sliding + global layers): a 2-D padding mask
    gives the first real token of each left-padded row; a dict of prebuilt masks (which Gemma 2/3
    decoders accept) is refused with the same clear error as a 4-D mask (before: AttributeError)."""
    hf, tok = plain_gemma3
    tok.padding_side = "left"
    b = tok(["w1 w2 w3 w4", "w5 w6"], return_tensors="pt", padding=True)
    spec = WeMask.build(hf, [1, 2], 0.5, "weight")
    seen = []
    edit = spec.edit

    def recording(h, layer, target, resid):
        seen.append(target.nonzero().tolist())
        return edit(h, layer, target, resid)

    object.__setattr__(spec, "edit", recording)
    first = b["attention_mask"].argmax(-1).tolist()
    assert first[1] > 0  # the short row is left-padded
    with torch.no_grad(), hf_interventions(hf, spec, positions_from="mask"):
        hf(**b)
        assert seen == [[[0, first[0]], [1, first[1]]]] * 2
        m4 = torch.ones(2, 1, b["input_ids"].shape[1], b["input_ids"].shape[1], dtype=torch.bool)
        for bad, what in (
            ({"full_attention": m4, "sliding_attention": m4}, "dict of prebuilt masks"),
            (m4, "4-D tensor"),
        ):
            with pytest.raises(ValueError, match=f"needs the 2-D .*got a {what}"):
                hf(b["input_ids"], attention_mask=bad)


def test_load_hf_and_local_path_resolve_packaged_names(tmp_path, monkeypatch):
    """``load_hf("gemma-3-270m")`` loads the packaged model's cache directory, which
    :func:`me_interp.models.local_path` gives (the cache functions replaced by a saved tiny model)."""
    from me_interp import models
    from me_interp.interventions import load_hf
    from me_interp.loading import bundled, packaged  # where local_path looks the caches up

    hf, tok = synthetic.tiny_llama(2)
    hf.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    monkeypatch.setattr(packaged, "ensure_packaged_cache", lambda name, rebuild=False: tmp_path)
    monkeypatch.setattr(bundled, "ensure_bundled_cache", lambda rebuild=False: tmp_path / "b")
    assert models.local_path("gemma-3-270m") == str(tmp_path)
    assert models.local_path(None) == models.local_path("bundled") == str(tmp_path / "b")
    for other in ("some/hub-name", "synthetic:planted", str(tmp_path), hf):
        assert models.local_path(other) is None
    loaded, _ = load_hf("gemma-3-270m")
    for (k, v), (k2, v2) in zip(hf.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)
