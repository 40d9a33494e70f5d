"""Every position, and left padding: the probes, the Site and WeMask follow each row's real tokens."""

from __future__ import annotations

import pytest
import torch

from me_interp import load_model, names, synthetic
from me_interp.interventions.wemask import index_positions, we_mask
from me_interp.loading.align import align
from me_interp.probes.attention import mean_to_keys
from me_interp.probes.positions import key_means, scan_positions
from me_interp.probes.site import locate


def _left(model, batch):
    rows = [batch.tokens[i, :n].tolist() for i, n in enumerate(batch.lengths)]
    return model.batch_from_ids(rows, prompts=batch.prompts, side="left")


def test_align_moves_each_row_first_real_token_to_index_0():
    x = torch.tensor([[9, 9, 1, 2], [3, 4, 5, 6]])
    assert align(x, [2, 0]).tolist() == [[1, 2, 9, 9], [3, 4, 5, 6]]
    p = torch.arange(2 * 1 * 4 * 4).view(2, 1, 4, 4)
    out = align(p, [1, 0], (2, 3))
    assert out[0, 0, 0, 0] == p[0, 0, 1, 1] and torch.equal(out[1], p[1])


@pytest.mark.parametrize("arch", synthetic.ARCHS)
def test_left_padding_gives_the_unpadded_site_state_and_wemask(arch):
    hf, tok, plant = synthetic.planted(arch)
    model = load_model(hf, tokenizer=tok, device="cpu")
    batch = model.tokenize(synthetic.planted_prompts())
    left = _left(model, batch)
    assert left.left_padded and left.starts == [max(batch.lengths) - n for n in batch.lengths]
    s, sl = locate(model, batch), locate(model, left)
    assert (s.layer, s.positions, s.dims, s.units.keys) == (
        sl.layer,
        sl.positions,
        sl.dims,
        sl.units.keys,
    )
    assert all(p == (0,) for p in sl.positions)  # the first real token, never a pad
    a, b = scan_positions(model, batch), scan_positions(model, left)
    for r, ref in enumerate(s.reference):
        h, hl = a.states.state(s.layer, r, ref), b.states.state(s.layer, r, ref)
        assert float((hl - h).norm() / h.norm()) < 1e-4
    # WeMask: the default position 0 follows the first real token under left padding
    hooks = we_mask(model, 0.5, layers=[s.layer + 1], batch=batch)
    hooks_left = we_mask(model, 0.5, layers=[s.layer + 1], batch=left)
    out, out_l = {}, {}
    name = names.resid_post(model.n_layers - 1)
    save = lambda store: lambda x, hook: store.__setitem__("h", x.detach().clone())  # noqa: E731
    model.run_with_hooks(batch, [*hooks, (name, save(out))])
    model.run_with_hooks(left, [*hooks_left, (name, save(out_l))])
    plain = {}
    model.run_with_hooks(batch, [(name, save(plain))])
    assert not torch.allclose(out["h"][:, 0], plain["h"][:, 0])  # the mask acted on token 0
    got = align(out_l["h"], left.starts)
    for r, n in enumerate(batch.lengths):
        torch.testing.assert_close(got[r, :n], out["h"][r, :n], rtol=1e-4, atol=1e-3)


def test_index_positions():
    model = load_model("synthetic:planted", device="cpu")
    left = _left(model, model.tokenize(synthetic.planted_prompts(3)))
    assert index_positions((0,), left) == tuple((s,) for s in left.starts)
    assert index_positions(((0,), (1,), (0, 2)), left)[2] == (left.starts[2], left.starts[2] + 2)


def test_scan_positions_lists_the_planted_secondary():
    secondary = load_model("synthetic:decoy-secondary", device="cpu")
    prompts = synthetic.distinct_first_prompts(6)
    found = scan_positions(secondary, secondary.tokenize(prompts))
    assert sorted({t.position for t in found.tokens}) == [0, synthetic.DELIMITER_POSITION]
    plant = synthetic.decoy("secondary")[2]
    for t in found.tokens:
        assert t.birth == 2 and t.dims == (plant.massive_dim,) and t.overlap == 1.0
        assert t.cosine > 0.99 and t.eraser == "" and t.last == secondary.n_layers - 1
    assert {t.text for t in found.tokens if t.position} == {f"w{synthetic.N_STARTERS}"}
    twin = load_model("synthetic:planted-nobos", device="cpu")
    only = scan_positions(twin, twin.tokenize(prompts))
    assert {t.position for t in only.tokens} == {0}


def test_erased_token_lifetime_and_eraser():
    model = load_model("synthetic:decoy-erased", device="cpu")
    found = scan_positions(model, model.tokenize(synthetic.distinct_first_prompts(4)))
    plant = synthetic.decoy("erased")[2]
    first = [t for t in found.tokens if t.position == 0]
    assert first and all(t.birth == 2 and t.last == plant.erased_at - 1 for t in first)
    assert all(t.eraser == "ffn" for t in first)


def test_key_means_is_mean_to_keys_on_causal_patterns():
    gen = torch.Generator().manual_seed(0)
    T = 7
    scores = torch.randn(3, 2, T, T, generator=gen)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    pattern = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    qmask = torch.ones(3, T, dtype=torch.bool)
    qmask[1, 5:] = False  # a right-padded row: its pads are no queries
    qmask[2, :] = False
    qmask[2, 2] = True  # one real query: only the keys before it have one after them
    got, ref = key_means(pattern, qmask), mean_to_keys(pattern, qmask)
    assert torch.equal(got.isnan(), ref.isnan())
    torch.testing.assert_close(got.nan_to_num(-1), ref.nan_to_num(-1), rtol=1e-5, atol=1e-6)
    assert got[:, :, -1].isnan().all() and not got[0, :, :-1].isnan().any()
    assert got[1, :, 4:].isnan().all() and got[2, :, 2:].isnan().all()
