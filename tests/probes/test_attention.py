"""Attention probes: entropy fixed points, sink rate, BOS metric, re-derivations, the planted sink."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from me_interp import names
from me_interp.probes.attention import (
    AttentionRecorder,
    SinkRecorder,
    attention_entropy,
    attention_probe,
    attention_src_dst,
    attention_stats,
    head_sink_rate,
    sink_rate,
)
from me_interp.probes.batching import record


def test_entropy_fixed_points():
    for n in (1, 2, 7, 64):
        assert attention_entropy(torch.full((n,), 1.0 / n)).item() == pytest.approx(
            math.log(n), abs=1e-5
        )
    one_hot = torch.zeros(9)
    one_hot[3] = 1.0
    assert attention_entropy(one_hot).item() == pytest.approx(0.0, abs=1e-7)


def test_entropy_matches_numpy():
    a = torch.softmax(torch.randn(3, 5, 11), -1)
    an = a.double().numpy()
    np.testing.assert_allclose(attention_entropy(a).numpy(), -(an * np.log(an)).sum(-1), rtol=1e-5)


def test_sink_rate_matches_a_count():
    to = torch.rand(4, 6, 5)
    got = sink_rate(to, 0.3)
    for layer in range(4):
        want = sum(float(to[layer, b, h]) > 0.3 for b in range(6) for h in range(5)) / 30
        assert got[layer].item() == pytest.approx(want)
    per_head = head_sink_rate(to, 0.3)
    assert per_head.shape == (4, 5)
    assert torch.allclose(per_head.mean(-1), got)
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="eps"):
            sink_rate(to, bad)
        with pytest.raises(ValueError, match="eps"):
            head_sink_rate(to, bad)


def test_probe_matches_a_full_capture(tiny_nobos, word_prompts, capture):
    model = tiny_nobos
    batch = model.tokenize(word_prompts)
    ref = [1, 0, 1, 3]
    mpos = [[1, 3], [0], [2, 0], [3]]  # prompt 2 has 3 tokens: its massive position 2 is the last
    ap = attention_probe(model, batch, reference=ref, massive_positions=mpos, eps=0.2)
    acts = capture(model, batch, {f"p{L}": names.pattern(L) for L in range(3)})
    for L in range(3):
        A = acts[f"p{L}"].double().numpy()  # [batch head q k]
        for b, n in enumerate(batch.lengths):
            queries = list(range(1, n))
            second = [q for q in queries if q >= n // 2]
            for h in range(model.n_heads):
                to = np.mean([A[b, h, q, ref[b]] for q in range(ref[b] + 1, n)])  # q > m only
                assert ap.to_ref[L, b, h].item() == pytest.approx(to, rel=1e-5)
                ent = np.mean(
                    [
                        -(A[b, h, q, :n] * np.log(np.maximum(A[b, h, q, :n], 1e-30))).sum()
                        for q in queries
                    ]
                )
                assert ap.entropy[L, b, h].item() == pytest.approx(ent, rel=1e-5, abs=1e-6)
                bos = np.mean([A[b, h, q, 0] for q in second])
                assert ap.bos[L, b, h].item() == pytest.approx(bos, rel=1e-5)
                for p in (0, 1, 2, 3):
                    v = ap.to_each[p][L, b, h].item()
                    if p in mpos[b] and p < n - 1:
                        assert v == pytest.approx(
                            np.mean([A[b, h, q, p] for q in range(p + 1, n)]), rel=1e-5
                        )
                    else:
                        assert math.isnan(v)
    assert ap.sink_rate() == sink_rate(ap.to_ref, 0.2).tolist()
    assert sorted(ap.to_each) == [0, 1, 2, 3]


def test_attention_stats_keeps_working_and_agrees(tiny_nobos, word_prompts):
    batch = tiny_nobos.tokenize(word_prompts)
    st = attention_stats(tiny_nobos, batch)
    ap = attention_probe(tiny_nobos, batch)
    assert torch.allclose(st.to_positions, ap.to_ref, atol=1e-6)
    assert torch.allclose(st.entropy, ap.entropy, atol=1e-6)
    assert len(st.mean_to_positions()) == tiny_nobos.n_layers


def test_bad_inputs(tiny_nobos, word_prompts):
    batch = tiny_nobos.tokenize(word_prompts)
    with pytest.raises(ValueError, match="outside prompt 2"):
        attention_probe(tiny_nobos, batch, reference=[0, 0, 3, 0])
    with pytest.raises(ValueError, match="rows for 4 prompts"):
        attention_probe(tiny_nobos, batch, massive_positions=[[0]])
    with pytest.raises(ValueError, match="eps"):
        attention_probe(tiny_nobos, batch, eps=1.2)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        attention_probe(tiny_nobos, tiny_nobos.tokenize(["w1", "w2 w3"]))


def test_planted_sink_appears_downstream_and_not_before(planted, planted_prompts):
    model, plant = planted
    ap = attention_probe(model, model.tokenize(planted_prompts))
    head = ap.to_ref.mean(1)[:, plant.sink_head]  # [layer]
    assert head[plant.layer + 1 :].min() > 0.95
    assert head[: plant.layer + 1].max() < 0.35
    rate = ap.sink_rate()
    assert max(rate[: plant.layer + 1]) == 0.0
    assert min(rate[plant.layer + 1 :]) >= 1 / model.n_heads
    per_head = ap.head_sink_rate()
    assert all(per_head[L][plant.sink_head] == 1.0 for L in range(plant.layer + 1, model.n_layers))
    bos = ap.mean_bos()
    assert min(bos[plant.layer + 1 :]) > 1.5 * max(bos[: plant.layer + 1])


def test_recorder_mass_on_several_positions_matches_attention_stats(tiny_nobos, word_prompts):
    from me_interp.probes import AttentionRecorder, record

    batch = tiny_nobos.tokenize(word_prompts)
    positions = [[0, 2], [1], [0, 1], [3]]
    rec = AttentionRecorder(tiny_nobos, batch)
    record(tiny_nobos, batch, [rec])
    st = attention_stats(tiny_nobos, batch, positions)
    assert torch.allclose(rec.mass_on(positions), st.to_positions, atol=1e-6)
    # no query follows a prompt's last token: its mean attention is undefined (NaN), not 0
    for b, n in enumerate(batch.lengths):
        assert torch.isnan(rec.to_key[:, b, :, n - 1 :]).all()
        assert torch.isfinite(rec.to_key[:, b, :, : n - 1]).all()
    with pytest.raises(ValueError, match="outside prompt"):
        rec.mass_on([[0], [0], [9], [0]])
    with pytest.raises(ValueError, match="last token of prompt 2"):
        rec.mass_on([[0], [0], [2], [0]])


def test_attention_to_a_later_massive_token_counts_only_the_queries_after_it(planted):
    """The planted sink head attends to the massive "<s>" from every query after it. At m = 2 the
    queries q = 1 cannot see it: averaging over them too (q >= 1) would dilute the sink to ~2/3."""
    from me_interp.models import LoadedModel

    model, plant = planted
    no_bos = LoadedModel(
        model.bridge, model.hf, model.tokenizer, "p", "no", model.dtype, model.device
    )
    batch = no_bos.tokenize(["w1 w2 <s> w3 w4", "w5 <s> w6 w7 w8 w9"])
    ap = attention_probe(no_bos, batch, reference=[2, 1])
    head = ap.to_ref[plant.layer + 1 :, :, plant.sink_head]  # [later layer, prompt]
    assert head.min() > 0.95
    st = attention_stats(no_bos, batch, [[2], [1]])
    torch.testing.assert_close(st.to_positions, ap.to_ref)
    with pytest.raises(ValueError, match="last token"):
        attention_probe(no_bos, batch, reference=[4, 1])


def test_sink_recorder_matches_a_full_capture_and_the_attention_recorder(
    tiny_nobos, word_prompts, capture
):
    """out[l, b, h] = Σ_{p∈P_b} mean_{q>p} A[q, p] by hand, and the attention recorder's mass on the
    same positions from the same (chunked) forward."""
    model = tiny_nobos
    batch = model.tokenize(word_prompts)
    positions = [[0, 2], [1], [0, 1], [3]]
    sinks, full = SinkRecorder(model, batch, positions), AttentionRecorder(model, batch)
    record(model, batch, [sinks, full])
    torch.testing.assert_close(sinks.out, full.mass_on(positions), atol=1e-6, rtol=1e-5)
    acts = capture(model, batch, {L: names.pattern(L) for L in range(model.n_layers)})
    for L in range(model.n_layers):
        A = acts[L].double()  # [batch head q k]
        for b, n in enumerate(batch.lengths):
            want = sum(A[b, :, p + 1 : n, p].mean(-1) for p in positions[b])  # [head]
            torch.testing.assert_close(sinks.out[L, b].double(), want, atol=1e-6, rtol=1e-5)
    assert sinks.per_layer() == sinks.out.amax(-1).mean(-1).tolist()
    with pytest.raises(ValueError, match="rows for 4 prompts"):
        SinkRecorder(model, batch, [[0]])
    with pytest.raises(ValueError, match="outside prompt 2"):
        SinkRecorder(model, batch, [[0], [0], [3], [0]])


def _scale_at(x, hook, *, pos, factor):
    x = x.clone()
    x[:, pos] = x[:, pos] * factor
    return x


def test_attention_src_dst_by_hand(tiny_nobos, word_prompts, capture):
    """The attention of the queries after both positions to src and dst, and the norm ratios of
    both at one layer's output, from a full capture; fwd_hooks run in the same forward."""
    from functools import partial

    model = tiny_nobos
    batch = model.tokenize([p for p in word_prompts if len(p.split()) > 3])  # a query after dst
    src, dst, layers, R = 0, 2, [1, 2], 1
    att, ratios = attention_src_dst(model, batch, src, dst, layers, ratio_layer=R)
    assert att.shape == (2, 2, len(batch), model.n_heads) and ratios.shape == (2, len(batch))
    acts = capture(
        model, batch, {"h": names.resid_post(R), **{L: names.pattern(L) for L in layers}}
    )
    norms = acts["h"].double().norm(dim=-1)  # [batch pos]
    for i, L in enumerate(layers):
        A = acts[L].double()
        for b, n in enumerate(batch.lengths):
            for k, t in enumerate((src, dst)):
                want = A[b, :, dst + 1 : n, t].mean(-1)  # queries q > max(src, dst)
                torch.testing.assert_close(att[i, k, b].double(), want, atol=1e-6, rtol=1e-5)
    for b, n in enumerate(batch.lengths):
        for k, t in enumerate((src, dst)):
            others = [norms[b, u] for u in range(n) if u != t]
            want = float(norms[b, t] / (sum(others) / len(others)))
            assert float(ratios[k, b]) == pytest.approx(want, rel=1e-5)
    _, apart = attention_src_dst(model, batch, src, dst, [], ratio_layer=R, apart=True)
    for b, n in enumerate(batch.lengths):  # each over the tokens other than both
        for k, t in enumerate((src, dst)):
            others = [norms[b, u] for u in range(n) if u not in (src, dst)]
            want = float(norms[b, t] / (sum(others) / len(others)))
            assert float(apart[k, b]) == pytest.approx(want, rel=1e-5)
    hook = [(names.resid_post(R), partial(_scale_at, pos=dst, factor=10.0))]
    _, scaled = attention_src_dst(model, batch, src, dst, [], hook, ratio_layer=R)
    for b, n in enumerate(batch.lengths):
        others = [norms[b, u] for u in range(n) if u != dst]
        want = float(10 * norms[b, dst] / (sum(others) / len(others)))
        assert float(scaled[1, b]) == pytest.approx(want, rel=1e-5)
    empty, none = attention_src_dst(model, batch, src, dst, [])
    assert empty.shape == (0, 2, len(batch), 0) and none is None
    with pytest.raises(ValueError, match="a token after position 2"):
        attention_src_dst(model, model.tokenize(word_prompts), src, dst, layers)
