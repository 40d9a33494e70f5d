"""The down_proj probes of super-weight detection (Yu et al. 2024): the planted weight found exactly
in every architecture and nothing on the twin; the spikes against an independent HF computation; the
weight-only score and the neuron shares by hand; writes that erase told apart from those that build;
the weight-only tops; a given candidate's record."""

from __future__ import annotations

import pytest
import torch

from me_interp import claims, io, load_model, synthetic
from me_interp.edits import down_weights_zeroed
from me_interp.probes.batching import capture_prefix
from me_interp.probes.down_proj import (
    Candidate,
    candidate_at,
    candidates,
    down_proj_spikes,
    me_neuron_shares,
    output_ratio,
    top_writes,
    weight_only_scores,
    weight_only_tops,
    yu_spike_layers,
)

THR = claims.threshold("super_weight_spike")


def _planted_spikes(arch, plant):
    hf, tok, info = synthetic.planted(arch, plant=plant)
    model = load_model(hf, tokenizer=tok, device="cpu")
    batch = model.tokenize(synthetic.planted_prompts(6))
    return model, batch, info, down_proj_spikes(model, batch, [0] * len(batch))


@pytest.mark.parametrize("arch", synthetic.ARCHS)
def test_detection_finds_exactly_the_planted_weight_and_nothing_on_the_twin(arch):
    """The planted neuron n of layer P writes the massive dim D: W_down[D, n] of P is the super
    weight by construction; the twin (no boosted gain, no neuron) has no weight above threshold."""
    model, batch, plant, spikes = _planted_spikes(arch, True)
    cands, tops, me, _ = candidates(model, spikes, plant.layer, [plant.massive_dim])
    want = (plant.layer, plant.massive_dim, plant.neuron)
    assert [c.coord for c in cands] == [want]
    assert tops == [want] * len(batch)
    c = cands[0]
    assert c.stability == 1.0 and c.in_me_layer and c.massive_dim and c.me_neuron
    assert c.weight == pytest.approx(plant.down_scale) and c.write > 20 * THR
    assert c.share == pytest.approx(1.0, abs=1e-4)  # nothing else writes the massive dim
    assert c.abs_rank == 0 and c.weight_only_rank == 0
    assert me.top_neurons[0] == plant.neuron and me.top_shares[0] > 0.99
    # Yu et al.'s raw spikes: both above 50 in the planted layer, except where a post-FFN norm
    # (Gemma 2/3, post_gain 400) makes the massive value from a smaller down_proj input
    yu = [(d.layer, d.row, d.col) for d in yu_spike_layers(spikes)]
    raw_in = float(spikes.in_max()[plant.layer].median())
    assert yu == ([want] if raw_in > THR else [])
    assert yu == [want] or model.arch.post_ffn_norm is not None
    model, batch, plant, spikes = _planted_spikes(arch, False)
    cands, tops, _, _ = candidates(model, spikes, plant.layer, [plant.massive_dim])
    assert cands == [] and tops == [None] * len(batch)
    assert yu_spike_layers(spikes) == []
    best = max(
        float(top_writes(model, spikes, L, 1)[0][b][0][2])
        for L in range(model.n_layers)
        for b in range(len(batch))
    )
    assert best < THR


@pytest.mark.parametrize("arch", ["llama", "phi3", "gemma3"])
def test_spikes_against_an_independent_hf_computation(arch):
    """x, y (down_proj's input and output), the residual stream h it is added to and, on sandwich
    blocks, f·y = the post-FFN norm's output, from forward hooks on a plain HF copy; the write of
    the planted weight by hand."""
    model, batch, plant, spikes = _planted_spikes(arch, True)
    hf, tok, _ = synthetic.planted(arch)  # the same weights, never booted into a bridge
    got: dict = {}
    handles = []
    for L, blk in enumerate(hf.model.layers):
        lay = synthetic._Layer(blk, hf.config)
        handles.append(
            blk.mlp.down_proj.register_forward_hook(
                lambda m, i, o, L=L: got.update({("x", L): i[0], ("y", L): o})
            )
        )
        handles.append(
            lay.ffn_norm.register_forward_pre_hook(lambda m, i, L=L: got.update({("h", L): i[0]}))
        )
        if lay.post_ffn_norm is not None:
            handles.append(
                lay.post_ffn_norm.register_forward_hook(
                    lambda m, i, o, L=L: got.update({("post", L): o})
                )
            )
    enc = tok(synthetic.planted_prompts(6), return_tensors="pt", padding=True)
    assert torch.equal(enc["input_ids"], batch.tokens.cpu())
    with torch.no_grad():
        hf(**enc)
    for h in handles:
        h.remove()
    for L in range(model.n_layers):
        torch.testing.assert_close(spikes.x[L], got[("x", L)][:, 0].float(), atol=1e-3, rtol=1e-4)
        torch.testing.assert_close(spikes.y[L], got[("y", L)][:, 0].float(), atol=1e-3, rtol=1e-4)
        torch.testing.assert_close(spikes.h[L], got[("h", L)][:, 0].float(), atol=1e-3, rtol=1e-4)
        if ("post", L) in got:
            residual = got[("post", L)][:, 0].float()
            torch.testing.assert_close(
                spikes.scale[L] * spikes.y[L], residual, atol=1e-2, rtol=1e-4
            )
        else:
            assert torch.equal(spikes.scale[L], torch.ones_like(spikes.scale[L]))
        x = got[("x", L)][:, 0].abs()  # the largest |x| and |y| over the other real tokens
        others = got[("x", L)].abs().amax(-1).masked_fill(~enc["attention_mask"].bool(), 0)[:, 1:]
        torch.testing.assert_close(
            spikes.others_x[L], others.amax(-1).float(), rtol=1e-4, atol=1e-4
        )
        torch.testing.assert_close(spikes.in_max()[L], x.amax(-1).float(), rtol=1e-4, atol=1e-4)
    P, D, n = plant.layer, plant.massive_dim, plant.neuron
    w = float(hf.model.layers[P].mlp.down_proj.weight.detach()[D, n])
    want = (got[("x", P)][:, 0, n] * w).abs().float() * spikes.scale[P, :, D]
    torch.testing.assert_close(spikes.write(model, P, D, n), want, rtol=1e-5, atol=1e-3)
    assert bool(spikes.builds(model, P, D, n).all())


def test_weight_only_scores_and_neuron_shares_by_hand(planted):
    model, plant = planted
    L = plant.layer
    w = model.ffn_weights(L)
    g = model.ffn_norm_gain(L)
    omega = weight_only_scores(model, L)
    r, c = 3, 17
    d, gate, up = w.down.detach(), w.gate.detach(), w.up.detach()
    want = abs(float(d[r, c])) * float((gate[c] * g).norm()) * float((up[c] * g).norm())
    assert float(omega[r, c]) == pytest.approx(want, rel=1e-5)
    assert divmod(int(omega.argmax()), omega.shape[1]) == (plant.massive_dim, plant.neuron)
    batch = model.tokenize(synthetic.planted_prompts(6))
    spikes = down_proj_spikes(model, batch, [0] * len(batch))
    for layer in range(model.n_layers):
        assert float(me_neuron_shares(model, spikes, layer).sum()) == pytest.approx(1.0, abs=1e-4)


def test_builds_and_erases_on_the_erased_decoy():
    """decoy-erased: layer 4's neurons write minus the massive value; its largest erasing write is
    reported as an eraser, never as the super weight of layer 2."""
    hf, tok, rec = synthetic.decoy("erased")
    model = load_model(hf, tokenizer=tok, device="cpu")
    batch = model.tokenize(synthetic.distinct_first_prompts(8))
    spikes = down_proj_spikes(model, batch, [0] * len(batch))
    D = rec.massive_dim
    assert bool(spikes.builds(model, rec.layers[0], D, rec.neuron).all())
    _, _, _, erasers = candidates(model, spikes, rec.layers[0], [D])
    er = erasers[rec.erased_at]
    assert er.row == D and er.col in rec.eraser_neurons and er.write > THR


def test_weight_only_tops_and_a_given_candidate_by_hand(planted):
    """weight_only_tops is the argmax of ω and of |W_down| per layer; candidate_at records a given
    weight (the planted one: rank 0 on both; another: its ranks counted by hand)."""
    model, plant = planted
    tops = weight_only_tops(model)
    assert [t.layer for t in tops] == list(range(model.n_layers))
    for t in tops:
        omega = weight_only_scores(model, t.layer)
        A = model.ffn_weights(t.layer).down.detach().abs()
        o, a = t.omega, t.abs
        assert float(omega[o.row, o.col]) == pytest.approx(float(omega.max()))
        assert float(A[a.row, a.col]) == a.value == pytest.approx(float(A.max()))
    assert (tops[plant.layer].omega.row, tops[plant.layer].omega.col) == (
        plant.massive_dim,
        plant.neuron,
    )
    batch = model.tokenize(synthetic.planted_prompts(6))
    spikes = down_proj_spikes(model, batch, [0] * len(batch))
    L, D, n = plant.layer, plant.massive_dim, plant.neuron
    c = candidate_at(model, spikes, (L, D, n), L, [D], [n], stability=0.5)
    assert c.coord == (L, D, n) and c.stability == 0.5 and c.me_neuron and c.massive_dim
    assert c.abs_rank == 0 and c.weight_only_rank == 0
    assert c.write_per_prompt == pytest.approx(spikes.write(model, L, D, n).tolist())
    assert io.from_jsonable(Candidate, io.to_jsonable(c)) == c  # reads back as itself
    other = candidate_at(model, spikes, (L, 1, 2), L, [D], [n])
    W = model.ffn_weights(L).down.detach()
    assert other.abs_rank == int((W.abs() > W[1, 2].abs()).sum())
    assert not other.massive_dim and not other.me_neuron and other.weight == float(W[1, 2])
    with pytest.raises(ValueError, match="outside"):
        candidate_at(model, spikes, (L, 999, 0), L, [D], [n])


def _hf_ratio(model, batch, layer):
    """``max_t ‖h_t‖ / mean_{t≠argmax} ‖h_t‖`` of layer ``layer``'s output, from the plain HF forward."""
    with torch.no_grad():
        out = model.hf(batch.tokens, attention_mask=batch.attention_mask, output_hidden_states=True)
    norms = out.hidden_states[layer + 1].float().norm(dim=-1)  # [batch pos]
    rows = []
    for b, n in enumerate(batch.lengths):
        v = norms[b, :n]
        rows.append(float(v.max() / ((v.sum() - v.max()) / (n - 1))))
    return rows


def test_output_ratio_against_the_hf_forward_unedited_and_zeroed(planted):
    """R at a layer's output, from the whole forward and from the unedited prefix (blocks
    ``start..layer`` only), unedited and with the planted weight zeroed, against hidden states of
    the plain HF forward (right padding: prompts of different lengths)."""
    model, plant = planted
    prompts = [
        p + " extra words here" * (i % 3) for i, p in enumerate(synthetic.planted_prompts(6))
    ]
    batch = model.tokenize(prompts)
    assert len(set(batch.lengths)) > 1
    L = plant.layer
    want = _hf_ratio(model, batch, L + 1)
    assert output_ratio(model, batch, L + 1) == pytest.approx(want, rel=1e-5)
    prefix = capture_prefix(model, batch, [L], max_tokens=None)
    assert output_ratio(model, batch, L + 1, prefix, L) == pytest.approx(want, rel=1e-5)
    with down_weights_zeroed(model, [(L, plant.massive_dim, plant.neuron)]):
        zeroed = _hf_ratio(model, batch, L + 1)
        assert output_ratio(model, batch, L + 1, prefix, L) == pytest.approx(zeroed, rel=1e-5)
    assert max(zeroed) < 0.1 * min(want)  # the edit removed the massive token
