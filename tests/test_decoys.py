"""The decoy models (:func:`me_interp.synthetic.decoy`) and the no-BOS planted model are what they say.

Every check is an independent computation on the plain HF model (``output_hidden_states``,
``output_attentions`` and forward hooks on HF modules), never a me_interp probe: the massive token's
norm ratio ``‖h_pos‖ / mean_{t≠pos} ‖h_t‖`` at the block input (``resid_pre``), after attention
(``resid_mid``) and at the layer output (``resid_post``) of every layer shows exactly where and how
the massive activation was made.
"""

from __future__ import annotations

import pytest
import torch

from me_interp import synthetic

PROMPTS = synthetic.distinct_first_prompts(16, 10)


def _forward(hf, tok, prompts=PROMPTS):
    """HF forward of ``prompts``: per layer ``resid_pre`` / ``resid_mid`` / ``resid_post``
    ``[layer, batch, pos, d]``, the pre-FFN norm outputs, the attentions and the mask."""
    batch = tok(prompts, return_tensors="pt", padding=True)
    attn_out, ffn_in, post = {}, {}, {}
    hooks = []
    for i, blk in enumerate(hf.model.layers):
        hooks += [
            blk.self_attn.register_forward_hook(lambda m, a, o, i=i: attn_out.__setitem__(i, o[0])),
            blk.post_attention_layernorm.register_forward_hook(
                lambda m, a, o, i=i: ffn_in.__setitem__(i, o)
            ),
            blk.register_forward_hook(
                lambda m, a, o, i=i: post.__setitem__(i, o[0] if isinstance(o, tuple) else o)
            ),
        ]
    try:
        with torch.no_grad():
            out = hf(**batch, output_hidden_states=True, output_attentions=True)
    finally:
        for h in hooks:
            h.remove()
    n = len(hf.model.layers)
    pre = torch.stack(out.hidden_states[:n])
    mid = pre + torch.stack([attn_out[i] for i in range(n)])
    return {
        "pre": pre,
        "mid": mid,
        "post": torch.stack([post[i] for i in range(n)]),
        "ffn_in": torch.stack([ffn_in[i] for i in range(n)]),
        "attn": torch.stack(out.attentions),  # [layer batch head query key]
        "mask": batch["attention_mask"].bool(),
        "ids": batch["input_ids"],
    }


def _ratio(h, mask, pos: int):
    """``[layer, batch]`` ``‖h_pos‖ / mean of the other real tokens' norms``."""
    norms = h.norm(dim=-1)  # layer batch pos
    others = mask.clone()
    others[:, pos] = False
    mean_others = (norms * others).sum(-1) / others.sum(-1)
    return norms[:, :, pos] / mean_others


@pytest.fixture(scope="module")
def built():
    """Every decoy, and the planted no-BOS model and its twin: ``{name: (hf, tok, record, run)}``."""
    out = {}
    for kind in synthetic.DECOYS:
        hf, tok, rec = synthetic.decoy(kind)
        out[kind] = (hf, tok, rec, _forward(hf, tok))
    for name, plant in (("planted-nobos", True), ("twin-nobos", False)):
        hf, tok, rec = synthetic.planted_nobos(plant)
        out[name] = (hf, tok, rec, _forward(hf, tok))
    return out


def test_distinct_first_prompts_have_distinct_first_tokens_and_no_bos():
    tok = synthetic.word_tokenizer(add_bos=False)
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    firsts = [i[0] for i in ids]
    assert len(set(firsts)) == len(PROMPTS)
    assert set(firsts) <= set(synthetic.STARTER_IDS)
    assert synthetic.BOS_ID not in {t for i in ids for t in i}
    for i in ids:
        assert i[synthetic.DELIMITER_POSITION] == synthetic.DELIMITER_ID
        rest = [t for j, t in enumerate(i) if j not in (0, synthetic.DELIMITER_POSITION)]
        assert not set(rest) & {*synthetic.STARTER_IDS, synthetic.DELIMITER_ID}
    assert {len(i) for i in ids} == {8, 9, 10}
    with pytest.raises(ValueError):
        synthetic.distinct_first_prompts(synthetic.N_STARTERS + 1)


def test_default_planted_model_still_marks_only_bos():
    hf, _, plant = synthetic.planted_llama()
    emb = hf.get_input_embeddings().weight
    marked = (emb[:, list(plant.gain_dims)] != 0).all(-1).nonzero().flatten().tolist()
    assert marked == [synthetic.BOS_ID] and plant.marked_tokens == (synthetic.BOS_ID,)


@pytest.mark.parametrize("name", ["planted-nobos", *(f"decoy-{k}" for k in synthetic.DECOYS)])
def test_loads_by_name_through_models(name, built):
    from me_interp import load_model

    model = load_model(f"synthetic:{name}", device="cpu")
    hf, tok = built[name.removeprefix("decoy-")][:2]
    batch = model.tokenize(PROMPTS[:3])
    assert not model.bos_prepended(batch)
    ref = tok(PROMPTS[:3], return_tensors="pt", padding=True)
    assert torch.equal(batch.tokens, ref["input_ids"])
    with torch.no_grad():
        got = model.bridge(batch.tokens)
        want = hf(**ref).logits
    n = int(ref["attention_mask"][0].sum())
    torch.testing.assert_close(got[0, :n], want[0, :n], atol=1e-4, rtol=1e-4)


def test_unknown_decoy_is_refused():
    from me_interp import load_model
    from me_interp.models import ModelLoadError

    with pytest.raises(ValueError):
        synthetic.decoy("nope")
    with pytest.raises(ModelLoadError, match="decoy-<kind>"):
        load_model("synthetic:decoy-nope")


def test_planted_nobos_is_made_by_the_ffn_at_token_0_with_distinct_values(built):
    _, _, plant, r = built["planted-nobos"]
    P, D = plant.layer, plant.massive_dim
    pre, mid, post = (_ratio(r[s], r["mask"], 0) for s in ("pre", "mid", "post"))
    assert (post[P] / mid[P] >= 10).all() and (mid[P] / pre[P] < 1.5).all()
    assert (post[:P] < 3).all() and (post[P:] > 100).all()
    values = r["post"][P, :, 0, D]
    assert len(set(values.tolist())) == len(PROMPTS)  # one measurement per prompt, not one in all
    assert values.std() / values.mean() > 0.01
    assert (_ratio(built["twin-nobos"][3]["post"], r["mask"], 0) < 3).all()


def test_decoy_attention_is_written_by_an_attention_head_at_layer_p(built):
    hf, _, rec, r = built["attention"]
    (P,), D = rec.layers, rec.massive_dim
    pre, mid, post = (_ratio(r[s], r["mask"], 0) for s in ("pre", "mid", "post"))
    assert (mid[P] / pre[P] >= 10).all()  # the jump is in the attention sub-layer
    assert (post[P] / mid[P] < 1.5).all() and (post[P] / mid[P] > 0.67).all()
    assert (post[:P] < 3).all() and (post[P:] > 100).all()
    # token 0's attention output on D is the OV write of head `rec.head`, and it is token 0's alone
    attn_d = r["mid"][P, :, :, D] - r["pre"][P, :, :, D]
    assert (attn_d[:, 0] > 1000).all() and (attn_d[:, 1:].abs() < 1).all()
    hd = hf.config.head_dim
    cols = [c for c in range(hf.config.num_attention_heads * hd) if c // hd != rec.head]
    assert hf.model.layers[P].self_attn.o_proj.weight[D, cols].abs().max() == 0
    assert hf.model.layers[P].mlp.down_proj.weight[D].abs().max() == 0


def test_decoy_embedding_is_massive_from_the_embedding(built):
    _, _, rec, r = built["embedding"]
    pre, mid, post = (_ratio(r[s], r["mask"], 0) for s in ("pre", "mid", "post"))
    assert rec.layers == () and (pre[0] > 100).all()  # already at the input of layer 0
    before = torch.cat([pre[:1], post[:-1]])
    assert ((post / before - 1).abs() < 0.05).all()  # no layer changes it
    assert ((mid / pre - 1).abs() < 0.05).all()


def test_decoy_gradual_grows_by_modest_factors_to_a_massive_total(built):
    _, _, rec, r = built["gradual"]
    pre, mid, post = (_ratio(r[s], r["mask"], 0) for s in ("pre", "mid", "post"))
    before = torch.cat([pre[:1], post[:-1]])
    factor = post / before  # [layer, prompt]
    assert (factor < 10).all() and (post / mid < 10).all() and (mid / pre < 10).all()
    assert (post[-1] / pre[0] > 100).all() and (pre[0] < 3).all()
    assert (factor[1:] > 1.2).all()  # every one of layers 1..L-1 grows it (less while D is small)
    d_gain = r["post"][:, :, 0, rec.massive_dim] / r["pre"][:, :, 0, rec.massive_dim]
    assert (d_gain[1:] > 2).all() and (d_gain[1:] < 4).all()  # about x3 on the massive dim


def _gain_energy(hf, r, layer: int, k: int = 2) -> torch.Tensor:
    """Per prompt, the fraction of token 0's pre-FFN-normalised energy on the ``k`` largest-|gain|
    dims of ``layer``'s pre-FFN norm."""
    gain = hf.model.layers[layer].post_attention_layernorm.weight
    top = gain.abs().topk(k).indices
    e = r["ffn_in"][layer, :, 0] ** 2
    return e[:, top].sum(-1) / e.sum(-1)


def test_decoy_offgain_is_made_by_the_ffn_from_dims_the_gain_does_not_emphasise(built):
    hf, _, rec, r = built["offgain"]
    (P,) = rec.layers
    pre, mid, post = (_ratio(r[s], r["mask"], 0) for s in ("pre", "mid", "post"))
    assert (post[P] / mid[P] >= 10).all() and (mid[P] / pre[P] < 1.5).all()
    assert (post[:P] < 3).all() and (post[P:] > 100).all()
    gain = hf.model.layers[P].post_attention_layernorm.weight
    assert set(gain.abs().topk(2).indices.tolist()) == set(rec.gain_dims)
    assert (gain[list(rec.reads)] < 1.2).all()  # the neuron reads ordinary-gain dims
    assert (_gain_energy(hf, r, P) < 0.05).all()
    # the same statistic on the planted model: its big-gain dims carry token 0's energy
    phf, ptok, plant, pr = built["planted-nobos"]
    assert (_gain_energy(phf, pr, plant.layer) > 0.5).all()


def test_decoy_sinkonly_is_a_sink_without_a_massive_activation(built):
    _, _, rec, r = built["sinkonly"]
    attn, mask = r["attn"][:, :, rec.head], r["mask"]  # [layer batch query key]
    to0 = attn[..., 0]  # [layer batch query]
    real = mask[None, :, 1:].expand_as(to0[:, :, 1:])
    assert (to0[:, :, 1:][real] > 0.5).all()  # every query of every layer
    for s in ("pre", "mid", "post"):
        assert (_ratio(r[s], mask, 0) < 3).all()
        assert (r[s].norm(dim=-1)[:, mask].max() / r[s].norm(dim=-1)[:, mask].median()) < 3
    # on the twin of the same construction, head 0 does not sink
    tw = built["twin-nobos"][3]
    assert tw["attn"][:, :, 0, -1, 0].max() < 0.5


def test_decoy_later_is_massive_at_the_delimiter_not_at_token_0(built):
    _, _, rec, r = built["later"]
    (P,), pos, mask = rec.layers, rec.position, r["mask"]
    assert pos == synthetic.DELIMITER_POSITION != 0
    at = _ratio(r["post"], mask, pos)
    assert (at[P:] > 100).all() and (at[:P] < 3).all()
    assert (_ratio(r["post"], mask, 0) < 3).all()
    norms = r["post"].norm(dim=-1).masked_fill(~mask, 0)
    assert (norms[P:].argmax(-1) == pos).all()
    mid = _ratio(r["mid"], mask, pos)
    assert (at[P] / mid[P] >= 10).all()  # made by the FFN, as planted


def test_decoys_lists_every_kind_with_a_one_line_description(built):
    assert isinstance(synthetic.DECOYS, dict) and "erased" in synthetic.DECOYS
    for kind, what in synthetic.DECOYS.items():
        assert isinstance(what, str) and what.strip() and "\n" not in what
        assert built[kind][2].kind == kind


def test_decoy_erased_is_made_as_planted_then_erased_by_a_later_ffn(built):
    hf, _, rec, r = built["erased"]
    (P,), E, D, mask = rec.layers, rec.erased_at, rec.massive_dim, r["mask"]
    assert (P, E, len(hf.model.layers)) == (2, 4, synthetic.ERASED_LAYERS)
    pre, mid, post = (_ratio(r[s], mask, 0) for s in ("pre", "mid", "post"))
    assert (post[:P] < 3).all() and (post[P:E] > 100).all() and (post[E:] < 3).all()
    assert (post[P] / mid[P] >= 10).all() and (mid[P] / pre[P] < 1.5).all()  # the planted FFN
    assert (mid[E] > 100).all()  # still massive after layer E's attention: the FFN erases it
    # layer E's FFN output (resid_post - resid_mid) at token 0 points against the massive dim
    ffn = r["post"][E] - r["mid"][E]  # [batch pos d]
    cos = ffn[:, 0, D] / ffn[:, 0].norm(dim=-1)
    assert (cos < -0.9).all()
    # ... and writes about minus the massive value there (so its signed projection is negative)
    before = r["mid"][E, :, 0, D]
    assert (before > 1000).all()
    assert ((ffn[:, 0, D] / before + 1).abs() < 0.01).all()
    # on the other tokens the eraser writes nothing on D (they have no massive value)
    real = mask.clone()
    real[:, 0] = False
    assert ffn[..., D][real].abs().max() < 1e-3
    # only the eraser's neurons write the massive dim at layer E
    down = hf.model.layers[E].mlp.down_proj.weight
    assert set(torch.nonzero(down[D]).flatten().tolist()) == set(rec.eraser_neurons)
    values = r["mid"][E, :, 0, D]
    assert len(set(values.tolist())) == len(PROMPTS)  # distinct per prompt, all erased


def test_decoy_erased_has_no_room_without_a_later_layer():
    with pytest.raises(ValueError, match="no layer"):
        synthetic.decoy("erased", layer=synthetic.ERASED_LAYERS - 2)


DEEP_PROMPTS = synthetic.planted_prompts(16, 10)


@pytest.fixture(scope="module")
def deep():
    """The deep planted models: ``{name: (hf, tok, plant, run)}`` on the planted prompts."""
    out = {}
    for name in synthetic.DEEP:
        hf, tok, plant = synthetic.planted_deep(name)
        out[name] = (hf, tok, plant, _forward(hf, tok, DEEP_PROMPTS))
    return out


@pytest.mark.parametrize(
    "name, layer", [("planted-deep", 2), ("planted-deep-late", 6), ("twin-deep", None)]
)
def test_deep_models_are_planted_where_they_say(name, layer, deep):
    hf, tok, plant, r = deep[name]
    assert len(hf.model.layers) == synthetic.DEEP_LAYERS == 8
    assert tok("w1 w2")["input_ids"][0] == synthetic.BOS_ID  # BOS, like synthetic:planted
    post, mid = _ratio(r["post"], r["mask"], 0), _ratio(r["mid"], r["mask"], 0)
    if layer is None:
        assert not plant.planted and (post < 3).all()
        return
    assert plant.planted and plant.layer == layer
    assert (post[:layer] < 3).all() and (post[layer:] > 100).all()  # carried to the last layer
    assert (post[layer] / mid[layer] >= 10).all()  # made by the FFN of the planted layer
    # partners: 7 swap partners for planted-deep, 6 earlier layers for planted-deep-late
    assert len(hf.model.layers) - 1 >= 7 if layer == 2 else layer >= 6


def test_deep_twin_differs_from_both_planted_only_in_the_plant(deep):
    twin = deep["twin-deep"][0].state_dict()
    for name in ("planted-deep", "planted-deep-late"):
        hf, _, plant, _ = deep[name]
        changed = {k for k, v in hf.state_dict().items() if not torch.equal(v, twin[k])}
        L = plant.layer
        assert changed == {
            f"model.layers.{L}.post_attention_layernorm.weight",
            f"model.layers.{L}.mlp.gate_proj.weight",
            f"model.layers.{L}.mlp.up_proj.weight",
            f"model.layers.{L}.mlp.down_proj.weight",
        }


@pytest.mark.parametrize("name", list(synthetic.DEEP))
def test_deep_models_load_by_name(name, deep):
    from me_interp import load_model

    model = load_model(f"synthetic:{name}", device="cpu")
    hf, tok = deep[name][:2]
    batch = model.tokenize(DEEP_PROMPTS[:3])
    assert model.bos_prepended(batch)
    ref = tok(DEEP_PROMPTS[:3], return_tensors="pt", padding=True)
    assert torch.equal(batch.tokens, ref["input_ids"])
    with torch.no_grad():
        got, want = model.bridge(batch.tokens), hf(**ref).logits
    n = int(ref["attention_mask"][0].sum())
    torch.testing.assert_close(got[0, :n], want[0, :n], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError):
        synthetic.planted_deep("deep-nope")


# --- the planted models that need their sink (synthetic.planted_needsink) ------------------------

TEXTS = synthetic.word_texts(32, 12)


def _nll(hf, tok, texts, zero_dims=None, layers=()):
    """``[text, position]`` NLL of every next token (plain HF forward); ``zero_dims`` (a list per
    layer of ``layers``, or ``None``: every dim) of token 0's pre-attention norm output are zeroed in
    ``layers`` (WeMask by hand)."""
    batch = tok(texts, return_tensors="pt", padding=True)
    assert batch["attention_mask"].all()  # word_texts all have the same length: no padding

    def mask(dims):
        def hook(m, args, out):
            out = out.clone()
            out[:, 0, slice(None) if dims is None else dims] = 0.0
            return out

        return hook

    handles = [
        hf.model.layers[L].input_layernorm.register_forward_hook(
            mask(None if zero_dims is None else zero_dims[i])
        )
        for i, L in enumerate(layers)
    ]
    try:
        with torch.no_grad():
            logits = hf(**batch).logits
    finally:
        for h in handles:
            h.remove()
    logp = torch.log_softmax(logits[:, :-1].double(), -1)
    return -logp.gather(-1, batch["input_ids"][:, 1:, None])[..., 0]


def _ppl(nll) -> float:
    return float(nll.mean().exp())


def _top_gain_dims(hf, layer: int, k: int) -> list[int]:
    g = hf.model.layers[layer].input_layernorm.weight.detach().abs()
    return sorted(torch.argsort(g, descending=True, stable=True)[:k].tolist())


@pytest.fixture(scope="module")
def needsink():
    return {name: synthetic.planted_needsink(name) for name in synthetic.NEEDSINK}


def test_word_texts_are_runs_of_consecutive_words():
    assert len(set(TEXTS)) == len(TEXTS) == 32
    for t in TEXTS:
        ids = [int(w[1:]) for w in t.split()]
        assert len(ids) == 12 and ids[0] >= 1 and ids == list(range(ids[0], ids[0] + 12))
    starters = synthetic.word_texts(32, 12, starter=True)
    tok = synthetic.word_tokenizer(add_bos=False)
    for i, t in enumerate(starters):
        ids = tok(t)["input_ids"]
        assert ids[0] == synthetic.STARTER_IDS[i % synthetic.N_STARTERS] and len(ids) == 12
        rest = [int(w[1:]) for w in t.split()[1:]]
        assert rest == list(range(rest[0], rest[0] + 11)) and rest[0] >= 1
    assert len(set(starters)) == 32
    with pytest.raises(ValueError):
        synthetic.word_texts(4, 1)


@pytest.mark.parametrize("name", list(synthetic.NEEDSINK))
def test_needsink_bigram_model_predicts_the_word_texts(name, needsink):
    """Every word after the first is predicted almost surely (perplexity near 1); the first word,
    predicted from the massive <s>, is not (about uniform), so the pooled perplexity is below 2."""
    hf, tok, plant = needsink[name]
    nll = _nll(hf, tok, TEXTS)
    assert _ppl(nll[:, 1:]) < 1.01
    assert _ppl(nll) < 2.0
    assert nll[:, 0].mean() > 2.0  # from <s>: no bigram prediction
    gain, _ = synthetic.NEEDSINK[name]
    for L in range(plant.layer + 1, len(hf.model.layers)):
        assert float(hf.model.layers[L].input_layernorm.weight[plant.massive_dim].detach()) == gain


@pytest.mark.parametrize(
    ("name", "full_at_least", "massive_dim_at_least"),
    [("planted-needsink", 50.0, 50.0), ("planted-needsink-wide", 50.0, 50.0),
     ("planted-needsink-mild", 1.001, 1.001)],
)  # fmt: skip
def test_masking_the_sink_tokens_attention_input_raises_perplexity(
    name, full_at_least, massive_dim_at_least, needsink
):
    """Zeroing token 0's whole attention input from the ME layer on, or only its massive dim, raises
    the perplexity (× 50 and more; a little on -mild): the model needs its sink."""
    hf, tok, plant = needsink[name]
    layers = range(plant.layer, len(hf.model.layers))
    base = _ppl(_nll(hf, tok, TEXTS))
    full = _ppl(_nll(hf, tok, TEXTS, None, layers))
    only_d = _ppl(_nll(hf, tok, TEXTS, [[plant.massive_dim]] * len(layers), layers))
    assert full / base > full_at_least and only_d / base > massive_dim_at_least
    if name == "planted-needsink-mild":
        assert full / base < 1.05


@pytest.mark.parametrize(
    ("name", "takes_massive_dim"),
    [("planted-needsink", False), ("planted-needsink-wide", True),
     ("planted-needsink-mild", True)],
)  # fmt: skip
def test_weight_selected_dims_miss_or_take_the_massive_dim(name, takes_massive_dim, needsink):
    """The 3 largest pre-attention gains (r = 0.1 of 32 dims; read from the HF weights): with the
    massive dim's gain 0.5 they miss it and masking them leaves the perplexity unchanged; with 2.0
    they take it in every layer after the ME layer."""
    hf, tok, plant = needsink[name]
    layers = list(range(plant.layer, len(hf.model.layers)))
    dims = [_top_gain_dims(hf, L, 3) for L in layers]
    after = [plant.massive_dim in d for d, L in zip(dims, layers) if L > plant.layer]
    assert all(after) if takes_massive_dim else not any(after)
    ratio = _ppl(_nll(hf, tok, TEXTS, dims, layers)) / _ppl(_nll(hf, tok, TEXTS))
    if name == "planted-needsink":
        assert abs(ratio - 1) < 1e-3
    elif name == "planted-needsink-wide":
        assert ratio > 50


def test_word_mc_items_load_and_the_bigram_model_answers_them(needsink, tmp_path):
    """The items load as the WeMask experiment reads them; the bigram model's next-token logits
    (plain HF) pick the right choice of every item that offers the next word."""
    import json

    from me_interp import evaluation

    items = synthetic.word_mc_items(128)
    path = tmp_path / "items.json"
    path.write_text(json.dumps(items))
    loaded = evaluation.load_mc_items(str(path))
    hf, tok, _ = needsink["planted-needsink"]
    assert len(loaded) == 128 and {it.answer for it in loaded} == {0, 1, 2}
    n_open = 0
    for i, it in enumerate(items):
        ctx = tok(it["context"], return_tensors="pt")
        with torch.no_grad():
            logits = hf(**ctx).logits[0, -1]
        nxt = f"w{int(it['context'].split()[-1][1:]) + 1}"
        choice_ids = [tok.convert_tokens_to_ids(c) for c in it["choices"]]
        best = int(torch.argmax(logits[choice_ids]))
        if i % 8 == 7:  # open: the next word is not offered
            n_open += 1
            assert nxt not in it["choices"]
        else:
            assert it["choices"][it["answer"]] == nxt and best == it["answer"]
    assert n_open == 16
    assert all(nxt not in it["choices"] for it in synthetic.word_mc_items(8, open_every=1)
               for nxt in [f"w{int(it['context'].split()[-1][1:]) + 1}"])  # fmt: skip


@pytest.mark.parametrize("name", list(synthetic.NEEDSINK))
def test_needsink_models_load_by_name(name, needsink):
    from me_interp import load_model

    model = load_model(f"synthetic:{name}", device="cpu")
    hf, tok, _ = needsink[name]
    ref = tok(TEXTS[:3], return_tensors="pt", padding=True)
    with torch.no_grad():
        got = model.bridge(ref["input_ids"])
        want = hf(**ref).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="unknown needsink"):
        synthetic.planted_needsink("planted-needsink-nope")


@pytest.mark.parametrize("kind", list(synthetic.TWOSTEP))
def test_decoy_twostep_is_born_over_two_layers_by_the_factors_it_says(kind, built):
    _, _, rec, run = built[kind]
    r = _ratio(run["post"], run["mask"], 0).median(dim=1).values  # [layer], median over prompts
    r_in = float(_ratio(run["pre"][:1], run["mask"], 0).median())
    jumps = torch.cat([r[:1] / r_in, r[1:] / r[:-1]])
    want = synthetic.TWOSTEP[kind]
    assert rec.layers == synthetic.TWOSTEP_LAYERS == (2, 3)
    assert [float(jumps[i]) for i in rec.layers] == pytest.approx(list(want), rel=0.02)
    assert float(jumps[[0, 1, 4]].max()) < 2  # no other layer jumps
    assert min(want) > 10  # each above the 'jump' threshold


def test_decoy_fading_shrinks_by_its_factor_in_every_later_layer(built):
    _, _, rec, run = built["fading"]
    h = run["post"][:, :, 0, rec.massive_dim].abs().median(dim=1).values  # [layer]
    steps = h[3:] / h[2:-1]
    assert steps.tolist() == pytest.approx([synthetic.FADING_FACTOR] * 4, rel=0.02)
    assert float(h[2]) > 1000 and float(h[-1] / h[2]) < 0.2
