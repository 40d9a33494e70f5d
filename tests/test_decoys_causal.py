"""The decoys for the causal and sink claims (:func:`me_interp.synthetic.causal_decoy`) are what they
say.

Every check is an independent computation on the plain HF model (``output_hidden_states``,
``output_attentions`` and forward hooks on HF modules), never a me_interp probe, and most compare
the decoy with :func:`me_interp.synthetic.planted_nobos`, which it changes in one part only.
"""

from __future__ import annotations

import pytest
import torch

from me_interp import synthetic

PROMPTS = synthetic.distinct_first_prompts(16, 10)
ME = 2  # the planted layer of planted_nobos and of every causal decoy
SINK_HEAD = 0


def _forward(hf, tok, hooks=(), prompts=PROMPTS):
    """HF forward of ``prompts`` under ``hooks`` (``(module, forward_hook)`` pairs): hidden states
    ``[layer + 1, batch, pos, d]`` (``[0]``: the embeddings; ``[l + 1]``: layer ``l``'s output,
    before the final norm for the last layer), attentions ``[layer, batch, head, q, k]``, the
    attention mask, and each layer's FFN output ``[layer, batch, pos, d]``, all as edited by
    ``hooks``."""
    batch = tok(prompts, return_tensors="pt", padding=True)
    handles = [module.register_forward_hook(hook) for module, hook in hooks]  # edits first
    ffn, post = {}, {}
    for i, blk in enumerate(hf.model.layers):
        handles.append(blk.mlp.register_forward_hook(lambda m, a, o, i=i: ffn.__setitem__(i, o)))
        handles.append(
            blk.register_forward_hook(
                lambda m, a, o, i=i: post.__setitem__(i, o[0] if isinstance(o, tuple) else o)
            )
        )
    try:
        with torch.no_grad():
            out = hf(**batch, output_attentions=True)
    finally:
        for h in handles:
            h.remove()
    n = len(hf.model.layers)
    emb = hf.get_input_embeddings()(batch["input_ids"]).detach()
    return {
        "h": torch.stack([emb, *(post[i] for i in range(n))]).double(),
        "attn": torch.stack(out.attentions).double(),
        "mask": batch["attention_mask"].bool(),
        "ffn": torch.stack([ffn[i] for i in range(n)]).double(),
    }


def _sink(run, layers) -> float:
    """Mean attention of the sink head to token 0 over the real queries q > 0 and ``layers``."""
    m = run["mask"][:, 1:]
    a = run["attn"][list(layers), :, SINK_HEAD, 1:, 0]  # [layer batch q]
    return float(a[:, m].mean())


def _ratio(h, mask) -> torch.Tensor:
    """Per prompt ``‖h_0‖ / mean_{t>0} ‖h_t‖`` (``h``: ``[batch pos d]``)."""
    norms = h.norm(dim=-1)
    others = mask.clone()
    others[:, 0] = False
    return norms[:, 0] / ((norms * others).sum(-1) / others.sum(-1))


def _effective_rank(x: torch.Tensor) -> float:
    """``exp(entropy)`` of the normalised singular values of the rows ``x``."""
    s = torch.linalg.svdvals(x)
    q = s / s.sum()
    q = q[q > 0]
    return float(torch.exp(-(q * q.log()).sum()))


def _set_token0(module, value_fn):
    """A forward hook on ``module`` that replaces its output at token 0 by ``value_fn(output)``."""

    def hook(m, args, out):
        h = out[0] if isinstance(out, tuple) else out
        h = h.clone()
        h[:, 0] = value_fn(h)
        return (h, *out[1:]) if isinstance(out, tuple) else h

    return module, hook


@pytest.fixture(scope="module")
def built():
    """Every causal decoy and planted_nobos: ``{name: (hf, tok, record, run)}``."""
    out = {}
    for kind in synthetic.CAUSAL_DECOYS:
        hf, tok, rec = synthetic.decoy(kind)
        out[kind] = (hf, tok, rec, _forward(hf, tok))
    hf, tok, rec = synthetic.planted_nobos()
    out["planted-nobos"] = (hf, tok, rec, _forward(hf, tok))
    return out


def test_every_causal_decoy_is_a_decoy_with_a_one_line_description(built):
    for kind in synthetic.CAUSAL_DECOYS:
        what = synthetic.DECOYS[kind]
        assert what.strip() and "\n" not in what
        rec = built[kind][2]
        assert rec.kind == kind and isinstance(rec, synthetic.Decoy)
        assert rec.to_dict()["sink_reads"] == rec.sink_reads
    with pytest.raises(ValueError, match="leaves no layer"):
        synthetic.causal_decoy("rewritten", layer=3)  # 5 layers: no layer between 3 and 4


@pytest.mark.parametrize("kind", synthetic.CAUSAL_DECOYS)
def test_loads_by_name_through_models(kind, built):
    from me_interp import load_model

    model = load_model(f"synthetic:decoy-{kind}", device="cpu")
    hf, tok = built[kind][:2]
    ref = tok(PROMPTS[:3], return_tensors="pt", padding=True)
    batch = model.tokenize(PROMPTS[:3])
    assert not model.bos_prepended(batch)
    with torch.no_grad():
        got, want = model.bridge(batch.tokens), hf(**ref).logits
    n = int(ref["attention_mask"][0].sum())
    torch.testing.assert_close(got[0, :n], want[0, :n], atol=1e-4, rtol=1e-4)


def test_the_planted_mechanism_is_untouched_up_to_the_me_layer_except_where_said(built):
    """rewritten, collapse and sinkapart change nothing before the layer after the ME layer: token
    0's state up to the ME layer's output is planted_nobos's."""
    base = built["planted-nobos"][3]["h"]
    for kind in ("rewritten", "collapse", "sinkapart"):
        torch.testing.assert_close(built[kind][3]["h"][: ME + 2], base[: ME + 2])


def test_add_late_writer_writes_scale_silu_times_the_normalised_massive_value():
    """By hand: the late neuron now writes ``scale · silu(ĥ_D) · ĥ_D`` along D only (ĥ: the
    pre-FFN norm's output) instead of its random write, and nothing where ĥ_D = 0."""
    hf0, tok, p = synthetic.planted_nobos()
    hf, _, _ = synthetic.planted_nobos()
    late, n, d = synthetic.add_late_writer(hf, p, 3.0), synthetic.LATE_NEURON, p.massive_dim
    assert late == p.layer + 1
    got = {}
    norm = hf0.model.layers[late].post_attention_layernorm
    base = _forward(hf0, tok, [(norm, lambda m, a, o: got.__setitem__("x", o.double()))])
    run = _forward(hf, tok)
    x, mlp = got["x"], hf0.model.layers[late].mlp
    old = torch.nn.functional.silu(x @ mlp.gate_proj.weight[n].double()) * (
        x @ mlp.up_proj.weight[n].double()
    )
    want = -old[..., None] * mlp.down_proj.weight[:, n].double()  # the random write is gone
    want[..., d] += 3.0 * torch.nn.functional.silu(x[..., d]) * x[..., d]
    torch.testing.assert_close(run["ffn"][late] - base["ffn"][late], want, atol=1e-3, rtol=1e-4)
    assert float(x[:, 1:, d].abs().max()) == 0.0  # no massive value, no new write


def test_decoy_rewritten_writes_more_along_the_massive_direction_after_the_me_layer(built):
    _, _, rec, run = built["rewritten"]
    late, n = rec.late_writer
    assert late == ME + 1 < len(run["ffn"]) - 1  # after the ME layer, before the last layer
    assert rec.layers == (ME, late) and n == synthetic.LATE_NEURON
    D, f = rec.massive_dim, run["ffn"][late][:, 0]  # the late FFN's output at token 0
    h_me = run["h"][ME + 1][:, 0]  # the ME layer's output at token 0
    u = h_me.mean(0) / h_me.mean(0).norm()
    cos = torch.nn.functional.cosine_similarity(f, u[None], dim=-1)
    assert float(cos.min()) > 0.99  # along the massive direction
    assert float((f @ u).min()) > float((h_me @ u).max())  # more than the ME layer wrote
    assert float(run["ffn"][late][:, 1:, D].abs().max()) < 1.0  # only at the massive token
    base = built["planted-nobos"][3]
    assert float((base["ffn"][late][:, 0] @ u).abs().max()) < 1.0  # planted's late FFN does not


def test_decoy_collapse_copies_one_large_vector_into_every_other_token(built):
    _, _, rec, run = built["collapse"]
    base = built["planted-nobos"][3]
    L, dim, value = ME + 1, rec.collapse_dim, rec.collapse_value
    assert (L, dim) == (ME + 1, synthetic.COLLAPSE_DIM)
    mask = run["mask"].clone()
    mask[:, 0] = False
    added = (run["h"][L + 1] - base["h"][L + 1])[:, :, dim][mask]  # what layer L wrote more
    assert float(added.min()) > 0.8 * value and float(added.max()) < 1.1 * value
    assert float(run["h"][L + 1].abs()[mask].max()) < 100.0  # nothing new passes Sun's 100
    # by hand: the effective rank of the other tokens' states drops by more than 20 %
    for b in range(len(PROMPTS)):
        keep = mask[b]
        before = _effective_rank(run["h"][ME][b][keep])  # layer ME-1's output
        after = _effective_rank(run["h"][L + 1][b][keep])
        planted_after = _effective_rank(base["h"][L + 1][b][keep])
        assert after < 0.5 * before and after < 0.5 * planted_after
    # the massive token keeps its massive value
    torch.testing.assert_close(
        run["h"][L + 1][:, 0, rec.massive_dim], base["h"][L + 1][:, 0, rec.massive_dim]
    )


def test_decoy_varying_has_a_massive_value_whose_sign_is_the_starters(built):
    _, _, rec, run = built["varying"]
    D, h = rec.massive_dim, run["h"]
    sign = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(len(PROMPTS))]).double()
    v = h[ME + 1][:, 0, D]
    assert float((v * sign).min()) > 1000.0  # massive, with the starter's sign
    assert float(h[ME][:, 0, D].abs().max()) == 0.0  # not before the ME layer
    assert rec.sign_dim == synthetic.SIGN_DIM and synthetic.SIGN_DIM in rec.reads

    # by hand: the cross-input cosine of token 0 does not rise at the ME layer
    def mean_cos(x):
        c = torch.nn.functional.cosine_similarity(x[:, None], x[None], dim=-1)
        iu = torch.triu_indices(len(x), len(x), 1)
        return float(c[iu[0], iu[1]].mean())

    before = [mean_cos(h[L + 1][:, 0]) for L in range(ME)]
    after = [mean_cos(h[L + 1][:, 0]) for L in range(ME, len(h) - 1)]
    assert max(after) < min(before)
    base = built["planted-nobos"][3]["h"]
    assert min(mean_cos(base[L + 1][:, 0]) for L in range(ME, len(h) - 1)) > 0.99  # planted


def _remove_dims(hf, D):
    """Token 0's massive dim of the ME layer's output set to the other tokens' mean."""
    return _set_token0(
        hf.model.layers[ME],
        lambda h: torch.cat([h[:, 0, :D], h[:, 1:, D : D + 1].mean(1), h[:, 0, D + 1 :]], -1),
    )


def _remove_ffn(hf):
    """The ME layer's FFN output at token 0 set to the other tokens' mean (padding included: the
    prompts' lengths differ by at most 2 and padding comes after)."""
    return _set_token0(hf.model.layers[ME].mlp, lambda f: f[:, 1:].mean(1))


def _transplant(hf, D, dst: int = 5):
    """The ME layer's output: token 0's massive dim added to token ``dst`` (a second massive
    token, as ``transplant --mode difference`` with the ``add`` condition)."""

    def hook(m, args, out):
        h = (out[0] if isinstance(out, tuple) else out).clone()
        h[:, dst, D] += h[:, 0, D]
        return (h, *out[1:]) if isinstance(out, tuple) else h

    return hf.model.layers[ME], hook


def test_decoy_sinkapart_has_a_sink_that_does_not_depend_on_the_massive_activation(built):
    after = range(ME + 1, 5)
    for name, apart in (("sinkapart", True), ("planted-nobos", False)):
        hf, tok, rec, run = built[name]
        D = rec.massive_dim
        assert _sink(run, after) > 0.9  # a sink on the massive token after the ME layer
        removed = _forward(hf, tok, [_remove_dims(hf, D)])
        assert float(_ratio(removed["h"][ME + 1], removed["mask"]).max()) < 2.0  # removed
        moved = _forward(hf, tok, [_transplant(hf, D)])
        to_dst = float(moved["attn"][list(after), :, SINK_HEAD, 6:, 5].mean())
        if apart:
            assert _sink(removed, after) >= _sink(run, after)  # the sink stays
            assert to_dst < 0.05  # a massive component carries no sink
        else:  # planted: the same edits move the sink
            assert _sink(removed, after) < 0.5 * _sink(run, after)
            assert to_dst > 0.3
    rec = built["sinkapart"][2]
    assert rec.sink_reads == rec.gain_dims and rec.massive_dim not in rec.sink_reads
    k = built["sinkapart"][0].model.layers[ME + 1].self_attn.k_proj.weight.detach()
    slow = k.shape[1] // 4 // 2 - 1
    assert float(k[slow, rec.massive_dim]) == 0.0 and float(k[slow, 3]) == synthetic.APART_KEY


@pytest.mark.parametrize("kind", ["primed", "primedapart"])
def test_decoy_primed_ffn_output_is_not_the_state_and_removing_it_removes_the_activation(
    kind, built
):
    hf, tok, rec, run = built[kind]
    D = rec.massive_dim
    prime = -synthetic.PRIME_FRACTION * synthetic.MASSIVE_VALUE
    assert rec.prime == pytest.approx(prime)
    torch.testing.assert_close(run["h"][ME][:, 0, D], torch.full((16,), prime).double())
    f, h = run["ffn"][ME][:, 0], run["h"][ME + 1][:, 0]
    cos = torch.nn.functional.cosine_similarity(f, h, dim=-1)
    share = f.norm(dim=-1) / h.norm(dim=-1)
    assert float(cos.min()) > 0.99 and float(share.min()) > 1.05  # not the state: 107 % of it
    torch.testing.assert_close(
        h[:, D], torch.full((16,), synthetic.MASSIVE_VALUE).double(), atol=5.0, rtol=0
    )
    removed = _forward(hf, tok, [_remove_ffn(hf)])
    r0 = _ratio(run["h"][ME + 1], run["mask"]).mean()
    r1 = _ratio(removed["h"][ME + 1], removed["mask"]).mean()
    assert float((r1 - 1) / (r0 - 1)) <= 0.1  # removed (the 'removed' rule)
    assert float(removed["h"][ME + 1][:, 0, D].max()) < 0  # what is left points against D
    after = range(ME + 1, 5)
    assert _sink(run, after) > 0.9
    if kind == "primed":  # the sink head reads D: the sink goes
        assert _sink(removed, after) < 0.01
    else:  # the sink head reads the marker: the sink stays
        assert _sink(removed, after) >= _sink(run, after)
