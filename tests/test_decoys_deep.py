"""The deep decoys (:func:`me_interp.synthetic.decoy_deep`) are what they say.

Every check is an independent computation on the plain HF model (``output_hidden_states``, forward
hooks on HF modules, parameters exchanged or copied by hand on a deep copy), never a me_interp
probe or edit: token 0's norm ratio ``‖h_0‖ / mean_{t≠0} ‖h_t‖`` at the block input (``pre``),
after attention (``mid``) and at the layer output (``post``) shows where and by which sub-layer the
massive activation is made, and where it goes when a part of layer 6 is exchanged with (or copied
into) another layer.
"""

from __future__ import annotations

import copy

import pytest
import torch

from me_interp import synthetic

PROMPTS = synthetic.distinct_first_prompts(16, 10)
M = synthetic.DEEP_DECOY_LAYER
ATTN, ATTN_NORM = ("self_attn",), ("input_layernorm",)
FFN, FFN_NORM = ("mlp",), ("post_attention_layernorm",)
FFN_PATH, BLOCK = (*FFN_NORM, *FFN), (*ATTN_NORM, *ATTN, *FFN_NORM, *FFN)


def _forward(hf, tok, prompts=PROMPTS):
    """``pre`` / ``mid`` / ``post`` ``[layer, batch, pos, d]`` and the mask (one HF forward)."""
    batch = tok(prompts, return_tensors="pt", padding=True)
    attn_out = {}
    hooks = [
        blk.self_attn.register_forward_hook(lambda m, a, o, i=i: attn_out.__setitem__(i, o[0]))
        for i, blk in enumerate(hf.model.layers)
    ]
    try:
        with torch.no_grad():
            hs = hf(**batch, output_hidden_states=True).hidden_states
    finally:
        for h in hooks:
            h.remove()
    n = len(hf.model.layers)
    pre = torch.stack(hs[:n])
    mid = pre + torch.stack([attn_out[i] for i in range(n)])
    post = torch.stack([*hs[1:n], _last_block_output(hf, batch)])
    return {"pre": pre, "mid": mid, "post": post, "mask": batch["attention_mask"].bool()}


def _last_block_output(hf, batch):
    """The last block's output before the final norm (HF's last hidden state is normed)."""
    got = {}
    h = hf.model.layers[-1].register_forward_hook(lambda m, a, o: got.setdefault("x", o))
    try:
        with torch.no_grad():
            hf(**batch)
    finally:
        h.remove()
    out = got["x"]
    return out[0] if isinstance(out, tuple) else out


def _ratio(h, mask):
    """``[layer, batch]`` token 0's norm over the mean norm of the other real tokens."""
    norms = h.norm(dim=-1)
    others = mask.clone()
    others[:, 0] = False
    return norms[:, :, 0] / ((norms * others).sum(-1) / others.sum(-1))


def _me_layer(hf, tok) -> int | None:
    """The first layer whose output is massive at token 0 (median ratio > 100) from there to the
    last layer, or ``None``."""
    r = _forward(hf, tok)
    big = (_ratio(r["post"], r["mask"]).median(-1).values > 100).tolist()
    for L in range(len(big)):
        if all(big[L:]):
            return L
    return None


def _exchanged(hf, a: int, b: int, modules, copy_only: bool = False):
    """A copy of ``hf`` with the parameters of ``modules`` of layers ``a`` and ``b`` exchanged (or,
    ``copy_only``, ``a``'s copied into ``b``)."""
    out = copy.deepcopy(hf)
    la, lb = out.model.layers[a], out.model.layers[b]
    with torch.no_grad():
        for name in modules:
            for pa, pb in zip(
                getattr(la, name).parameters(), getattr(lb, name).parameters(), strict=True
            ):
                keep = pa.clone()
                if not copy_only:
                    pa.copy_(pb)
                pb.copy_(keep)
    return out


@pytest.fixture(scope="module")
def built():
    """``{kind: (hf, tok, record, run)}`` for every deep decoy."""
    out = {}
    for kind in synthetic.DEEP_DECOYS:
        hf, tok, rec = synthetic.decoy(kind)
        out[kind] = (hf, tok, rec, _forward(hf, tok))
    return out


def test_the_deep_decoys_are_listed_and_refused_elsewhere():
    assert set(synthetic.DEEP_DECOYS) == {
        "attention-deep",
        "offgain-deep",
        "gainonly-deep",
        "attngain-deep",
        "depthinput-deep",
    }
    assert set(synthetic.DEEP_DECOYS) <= set(synthetic.DECOYS)
    with pytest.raises(ValueError):
        synthetic.decoy_deep("attention")  # a shallow decoy is not a deep one


@pytest.mark.parametrize(
    "kind, site",
    [
        ("attention-deep", "attention"),
        ("offgain-deep", "ffn"),
        ("gainonly-deep", "ffn"),
        ("attngain-deep", "attention"),
        ("depthinput-deep", "ffn"),
    ],
)
def test_deep_decoy_is_made_at_layer_6_of_8_by_the_sub_layer_it_says(kind, site, built):
    hf, tok, rec, r = built[kind]
    assert len(hf.model.layers) == 8 and rec.layers == (M,) == (6,) and rec.kind == kind
    assert synthetic.BOS_ID not in tok(PROMPTS[0])["input_ids"]  # no BOS: token 0 is distinct
    pre, mid, post = (_ratio(r[s], r["mask"]) for s in ("pre", "mid", "post"))
    assert (post[: M - 1] < 3).all() and (post[M:] > 100).all()  # made at 6, carried to the end
    # layer 5 (depthinput-deep: its FFN writes the marker, about 6 on two dims) is far from massive
    assert (post[M - 1] < (5 if kind == "depthinput-deep" else 3)).all()
    attn_gain, ffn_gain = mid[M] / pre[M], post[M] / mid[M]
    if site == "attention":
        assert rec.made_by == "attention" and (attn_gain >= 10).all() and (ffn_gain < 1.5).all()
    else:
        assert rec.made_by == "ffn" and (ffn_gain >= 10).all() and (attn_gain < 1.5).all()
    # token 0 is a distinct measurement in every prompt
    assert len(set(r["post"][M, :, 0, rec.massive_dim].tolist())) == len(PROMPTS)


@pytest.mark.parametrize(
    "kind, modules, partner, want",
    [
        # attention-deep: the attention moves it (earlier and later), the FFN path does not
        ("attention-deep", ATTN, 2, 2),
        ("attention-deep", ATTN, 7, 7),
        ("attention-deep", FFN_PATH, 2, M),
        ("attention-deep", ATTN_NORM, 2, M),
        # offgain-deep: the FFN alone moves it, its pre-FFN gain does not
        ("offgain-deep", FFN, 2, 2),
        ("offgain-deep", FFN_NORM, 2, M),
        # gainonly-deep: the pre-FFN gain alone moves it, the FFN does not
        ("gainonly-deep", FFN_NORM, 2, 2),
        ("gainonly-deep", FFN_NORM, 7, 7),
        ("gainonly-deep", FFN, 2, M),
        # attngain-deep: the pre-attention gain alone moves it, the attention does not
        ("attngain-deep", ATTN_NORM, 2, 2),
        ("attngain-deep", ATTN_NORM, 7, 7),
        ("attngain-deep", ATTN, 2, M),
        # depthinput-deep: moved earlier, the mechanism sees no marker; moved later, a diluted one
        ("depthinput-deep", FFN_PATH, 2, None),
        ("depthinput-deep", FFN_PATH, 5, None),
        ("depthinput-deep", FFN_PATH, 7, None),
        ("depthinput-deep", BLOCK, 2, None),
        ("depthinput-deep", BLOCK, 7, None),
    ],
)
def test_exchanging_a_part_of_layer_6_by_hand_moves_it_where_the_decoy_says(
    kind, modules, partner, want, built
):
    hf, tok = built[kind][:2]
    assert _me_layer(hf, tok) == M
    assert _me_layer(_exchanged(hf, M, partner, modules), tok) == want


@pytest.mark.parametrize(
    "kind, modules, want",
    [
        ("attention-deep", ATTN, 2),
        ("attention-deep", FFN_PATH, M),
        ("offgain-deep", FFN, 2),
        ("gainonly-deep", FFN_NORM, 2),
        ("gainonly-deep", FFN, M),
        ("attngain-deep", ATTN_NORM, 2),
        ("attngain-deep", ATTN, M),
        ("depthinput-deep", FFN_PATH, M),  # copied earlier, the weights see no marker
        ("depthinput-deep", BLOCK, M),
    ],
)
def test_copying_a_part_of_layer_6_into_layer_2_by_hand(kind, modules, want, built):
    hf, tok = built[kind][:2]
    assert _me_layer(_exchanged(hf, M, 2, modules, copy_only=True), tok) == want


def test_attention_deep_only_head_2_of_layer_6_writes_the_massive_dim(built):
    hf, _, rec, r = built["attention-deep"]
    D, hd = rec.massive_dim, hf.config.head_dim
    for L, blk in enumerate(hf.model.layers):
        assert blk.mlp.down_proj.weight[D].abs().max() == 0
        o = blk.self_attn.o_proj.weight[D]
        writers = {c // hd for c in torch.nonzero(o).flatten().tolist()}
        assert writers == ({rec.head} if L == M else set())
    # and it writes token 0 alone
    attn_d = r["mid"][M, :, :, D] - r["pre"][M, :, :, D]
    assert (attn_d[:, 0] > 1000).all() and (attn_d[:, 1:].abs() < 1).all()
    gains = torch.stack([blk.post_attention_layernorm.weight for blk in hf.model.layers])
    assert (gains < 1.5).all()  # ordinary pre-FFN gains everywhere


def test_offgain_deep_reads_dims_whose_gain_is_ordinary(built):
    hf, _, rec, r = built["offgain-deep"]
    gain = hf.model.layers[M].post_attention_layernorm.weight
    assert set(gain.abs().topk(2).indices.tolist()) == set(rec.gain_dims)
    assert (gain[list(rec.reads)] < 1.2).all() and not set(rec.reads) & set(rec.gain_dims)
    # token 0 carries nothing on the boosted dims: their gain multiplies zero
    assert (r["mid"][M, :, 0][:, list(rec.gain_dims)] == 0).all()
    assert (r["mid"][M, :, 0][:, list(rec.reads)] == 1).all()


@pytest.mark.parametrize("kind, norm", [("gainonly-deep", FFN_NORM), ("attngain-deep", ATTN_NORM)])
def test_gain_decoys_have_the_same_writer_everywhere_and_one_boosted_gain(kind, norm, built):
    hf, _, rec, r = built[kind]
    G, D, layers = list(rec.gain_dims), rec.massive_dim, hf.model.layers
    # the writing neuron / head is the same in every layer (the rest of the FFN / attention is not)
    if kind == "gainonly-deep":
        n = rec.neuron
        part = [b.mlp for b in layers]
        rows = [torch.cat([f.gate_proj.weight[n], f.up_proj.weight[n], f.down_proj.weight[:, n]])
                for f in part]  # fmt: skip
    else:
        hd, group = (
            hf.config.head_dim,
            hf.config.num_attention_heads // hf.config.num_key_value_heads,
        )
        q = slice(rec.head * hd, (rec.head + 1) * hd)
        kv = slice(rec.head // group * hd, (rec.head // group + 1) * hd)
        part = [b.self_attn for b in layers]
        rows = [torch.cat([a.q_proj.weight[q].flatten(), a.k_proj.weight[kv].flatten(),
                           a.v_proj.weight[kv].flatten(), a.o_proj.weight[:, q].flatten()])
                for a in part]  # fmt: skip
    whole = [torch.cat([p.flatten() for p in x.parameters()]) for x in part]
    assert all(torch.equal(rows[0], row) for row in rows[1:])
    assert not any(torch.equal(whole[0], w) for w in whole[1:])
    # the boosted gain: 8 on G at layer 6, exactly 1 on the reads elsewhere
    gains = torch.stack([getattr(b, norm[0]).weight for b in layers])  # [layer d]
    assert (gains[M, G] == 8).all()
    others = [L for L in range(len(layers)) if L != M]
    assert (gains[others][:, list(rec.reads)] == 1).all()
    # ... so the writer writes exactly 0 on D at token 0 before layer 6, and the massive value there
    site = ("pre", "mid") if kind == "attngain-deep" else ("mid", "post")
    write = r[site[1]][:, :, 0, D] - r[site[0]][:, :, 0, D]  # [layer batch]
    assert (write[:M] == 0).all() and (write[M] > 1000).all()


def _ffn_path(blk, h):
    """Layer ``blk``'s pre-FFN norm + FFN applied to ``h`` (HF modules, by hand)."""
    with torch.no_grad():
        return blk.mlp(blk.post_attention_layernorm(h))


@pytest.mark.parametrize("name", ["depthinput-deep", "planted-deep-late"])
def test_only_inputs_from_depth_6_carry_the_marker_of_depthinput_deep(name, built):
    """Layer 6's FFN path fed token 0's FFN input of an earlier layer Y: outsized (≥ 10 × the
    other tokens' FFN output at 6) for every Y on planted-deep-late (marker in the embedding), for
    none on depthinput-deep (marker written by layer 5's FFN)."""
    if name == "depthinput-deep":
        hf, tok, rec, r = built[name]
        G = list(rec.gain_dims)
        emb = hf.get_input_embeddings().weight
        assert (emb[:, G] == 0).all() and rec.marker_written_at == M - 1
        marker = r["mid"][:, :, 0][..., G]  # [layer batch |G|]
        assert (marker[:M] == 0).all()  # up to layer 5's FFN input
        after = r["post"][M - 1, :, 0][:, G]
        # written by layer 5's FFN: the same on both dims, about 6 (most of token 0's rms)
        assert torch.equal(after[:, 0], after[:, 1]) and (after > 2).all()
        assert 4 < after.mean() < 8
    else:
        hf, tok, _ = synthetic.planted_deep(name)
        r = _forward(hf, tok, synthetic.planted_prompts(16, 10))
    blk = hf.model.layers[M]
    mid, mask = r["mid"], r["mask"]
    others = _ffn_path(blk, mid[M]).norm(dim=-1)  # [batch pos]
    other = mask.clone()
    other[:, 0] = False
    denom = torch.stack([others[b][other[b]].median() for b in range(len(mask))])
    cell = torch.stack([_ffn_path(blk, mid[Y, :, 0]).norm(dim=-1) / denom for Y in range(M + 1)])
    assert (cell[M] > 100).all()
    if name == "depthinput-deep":
        assert (cell[:M] < 10).all()
    else:
        assert (cell[:M] > 100).all()
