"""Per-layer norms from the TransformerLens hooks against an independent HF computation."""

from __future__ import annotations

import pytest
import torch

from me_interp import names
from me_interp.probes.norms import ratio_to_others, scan_norms, top_ratio


def _hf_reference(model, batch):
    """Norms at every site from plain HF forward hooks and output_hidden_states (no TL involved)."""
    hf = model.hf
    layers = [model.block_module(i) for i in range(model.n_layers)]
    got: dict[tuple[str, int], torch.Tensor] = {}
    handles = []

    def keep(key):
        def fn(mod, args, out):
            t = out[0] if isinstance(out, tuple) else out
            got[key] = t.detach().float()

        return fn

    for i, layer in enumerate(layers):
        handles.append(model.attn_norm_module(i).register_forward_hook(keep(("attn_in", i))))
        handles.append(model.ffn_norm_module(i).register_forward_hook(keep(("ffn_in", i))))
        handles.append(layer.mlp.register_forward_hook(keep(("ffn_out", i))))
        handles.append(layer.self_attn.register_forward_hook(keep(("attn_out", i))))
    try:
        with torch.no_grad():
            out = hf(
                input_ids=batch.tokens,
                attention_mask=batch.attention_mask,
                output_hidden_states=True,
            )
    finally:
        for h in handles:
            h.remove()
    hs = [h.float() for h in out.hidden_states]
    ref = {}
    for i in range(model.n_layers):
        ref[("resid_pre", i)] = hs[i]
        ref[("resid_mid", i)] = hs[i] + got[("attn_out", i)]
        for s in ("attn_in", "ffn_in", "ffn_out", "attn_out"):
            ref[(s, i)] = got[(s, i)]
        if i < model.n_layers - 1:  # HF's last hidden state is after the final norm
            ref[("resid_post", i)] = hs[i + 1]
    # the last layer's output, independently: mid + ffn_out
    last = model.n_layers - 1
    ref[("resid_post", last)] = ref[("resid_mid", last)] + got[("ffn_out", last)]
    return {k: v.norm(dim=-1) for k, v in ref.items()}


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3", "planted"])
def test_norms_match_hf(fixture, request, planted_prompts):
    model = request.getfixturevalue(fixture)
    model = model[0] if isinstance(model, tuple) else model
    batch = model.tokenize(planted_prompts)
    scan = scan_norms(model, batch)
    ref = _hf_reference(model, batch)
    mask = batch.attention_mask.bool()
    for (site, layer), r in ref.items():
        got = scan.site_norms(site)[layer]
        torch.testing.assert_close(got[mask], r[mask], rtol=1e-5, atol=1e-5, msg=f"{site} {layer}")
        assert torch.isnan(got[~mask]).all()


def test_norms_match_hf_on_bundled(bundled):
    batch = bundled.tokenize(["The capital of France is Paris.", "def f(x):\n    return x"])
    scan = scan_norms(bundled, batch)
    ref = _hf_reference(bundled, batch)
    mask = batch.attention_mask.bool()
    for (site, layer), r in ref.items():
        torch.testing.assert_close(
            scan.site_norms(site)[layer][mask], r[mask], rtol=1e-4, atol=1e-3, msg=f"{site} {layer}"
        )


def test_padded_rows_equal_unpadded_runs(planted):
    model, _ = planted
    prompts = ["w1 w2 w3 w4 w5 w6", "w9 w8", "w20 w21 w22 w23"]
    batched = scan_norms(model, model.tokenize(prompts))
    for i, p in enumerate(prompts):
        alone = scan_norms(model, model.tokenize([p]))
        n = alone.mask.shape[1]
        torch.testing.assert_close(
            batched.norms[:, :, i, :n], alone.norms[:, :, 0], rtol=1e-5, atol=1e-5
        )
        torch.testing.assert_close(
            batched.median_abs[:, i], alone.median_abs[:, 0], rtol=1e-6, atol=1e-6
        )
        torch.testing.assert_close(
            batched.top_abs[:, i, :n], alone.top_abs[:, 0], rtol=1e-5, atol=1e-5
        )


def test_top_values_and_median_match_direct_computation(planted, planted_prompts):
    model, _ = planted
    batch = model.tokenize(planted_prompts)
    store = {}

    def keep(x, hook, layer):
        store[layer] = x.detach().clone()
        return x

    from functools import partial

    model.run_with_hooks(
        batch, [(names.resid_post(i), partial(keep, layer=i)) for i in range(model.n_layers)]
    )
    scan = scan_norms(model, batch, top_k=4, keep_prompt=1)
    for layer, x in store.items():
        a = x.abs()
        for b in range(len(batch)):
            n = batch.lengths[b]
            vals = a[b, :n].flatten()
            assert torch.isclose(
                scan.median_abs[layer, b], vals.median(), rtol=1e-6
            ) or torch.isclose(scan.median_abs[layer, b], vals.sort().values[(len(vals) - 1) // 2])
            torch.testing.assert_close(scan.top_abs[layer, b, :n, 0], a[b, :n].max(-1).values)
        torch.testing.assert_close(scan.kept_resid[layer], x[1, : batch.lengths[1]])


def test_ratio_helpers_against_hand_computation():
    norms = torch.tensor([[3.0, 1.0, 2.0, 7.0], [1.0, 9.0, 1.0, float("nan")]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]).bool()
    r = ratio_to_others(norms, mask, torch.tensor([0, 1]))
    torch.testing.assert_close(r, torch.tensor([3.0 / (10.0 / 3), 9.0 / 1.0]))
    t = top_ratio(norms, mask)
    torch.testing.assert_close(t, torch.tensor([7.0 / 2.0, 9.0]))
    # a metric of a token against identical tokens is 1
    same = torch.ones(1, 5)
    assert float(top_ratio(same, same.bool())) == 1.0


def test_single_token_prompt_is_a_clear_error():
    norms = torch.tensor([[3.0, float("nan")]])
    mask = torch.tensor([[1, 0]]).bool()
    with pytest.raises(ValueError, match="single token"):
        ratio_to_others(norms, mask, torch.tensor([0]))
    with pytest.raises(ValueError, match="single token"):
        top_ratio(norms, mask)


def test_unknown_site_and_keep_prompt(planted):
    model, _ = planted
    batch = model.tokenize(["w1 w2"])
    with pytest.raises(ValueError, match="unknown site"):
        scan_norms(model, batch, sites=("nope",))
    with pytest.raises(ValueError, match="keep_prompt"):
        scan_norms(model, batch, keep_prompt=3)


def test_fp16_overflow_is_detected():
    from me_interp import load_model

    model = load_model("synthetic:planted", dtype="float16", device="cpu")
    # scale the planted neuron far past fp16's range
    with torch.no_grad():
        model.ffn_weights(2).down[7, 5] = 60000.0
    with pytest.raises(FloatingPointError, match="fp16"):
        scan_norms(model, model.tokenize(["w1 w2 w3"]))
