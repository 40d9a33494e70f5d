"""Running probes in length-sorted chunks, several in one forward, on prefixes, without logits: the
values must be those of one plain padded forward."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from me_interp import names
from me_interp.probes import (
    AlignmentRecorder,
    AttentionRecorder,
    FFNAtRecorder,
    FFNRecorder,
    GeometryRecorder,
    InvarianceRecorder,
    NormRecorder,
    alignment_scan,
    attention_probe,
    chunks,
    ffn_scan,
    geometry_scan,
    invariance_scan,
    record,
    scan_norms,
)
from me_interp.probes.batching import ResidMidRecorder, stop_hook_name
from me_interp.probes.ffn import make_scan

PROMPTS = [
    "w1 w2 w3 w4 w5 w6 w7 w8 w9",
    "w9 w8",
    "w20 w21 w22 w23",
    "w30 w31 w32 w33 w34 w35 w36",
    "w40 w41 w42",
    "w50 w51 w52 w53 w54 w55",
]


@pytest.fixture(scope="module")
def batch(tiny_nobos):
    return tiny_nobos.tokenize(PROMPTS)


def test_chunks_cover_every_row_once_sorted_by_length_within_budget(batch):
    cs = chunks(batch, max_tokens=12)
    rows = sorted(r for c in cs for r in c.rows.tolist())
    assert rows == list(range(len(PROMPTS)))
    for c in cs:
        assert len(c) * c.width <= 12 or len(c) == 1
        assert c.lengths == [batch.lengths[r] for r in c.rows.tolist()]
        assert c.width == max(c.lengths)
        for i, r in enumerate(c.rows.tolist()):
            n = batch.lengths[r]
            assert torch.equal(c.batch.tokens[i, :n], batch.tokens[r, :n])
            assert c.batch.attention_mask[i].sum() == n
    widths = [c.width for c in cs]
    assert widths == sorted(widths)


def test_chunks_of_rows_and_prefixes(batch):
    upto = [1, 2, 3, 4, 2, 6]
    cs = chunks(batch, rows=[5, 0, 3], upto=upto)
    assert sorted(r for c in cs for r in c.rows.tolist()) == [0, 3, 5]
    for c in cs:
        for i, r in enumerate(c.rows.tolist()):
            assert c.lengths[i] == upto[r]
            assert int(c.batch.attention_mask[i].sum()) == upto[r]


@pytest.mark.parametrize(
    "kwargs, msg",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"rows": [6]}, "out of range"),
        ({"upto": [1, 1]}, "entries for 6 prompts"),
        ({"upto": [0, 1, 1, 1, 1, 1]}, r"outside \[1, "),
        ({"upto": [99, 1, 1, 1, 1, 1]}, r"outside \[1, "),
    ],
)
def test_chunks_reject_bad_arguments(batch, kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        chunks(batch, **kwargs)


def test_the_forward_stops_before_the_unembedding(tiny_nobos, batch):
    model = tiny_nobos
    assert stop_hook_name(model) == "ln_final.hook_in"
    assert stop_hook_name(model, 0) == names.resid_pre(1)
    seen: list[str] = []

    def spy(x, hook, name):
        seen.append(name)
        return x

    class Spy:
        def hooks(self, chunk):
            return [
                (n, partial(spy, name=n))
                for n in (names.resid_post(model.n_layers - 1), "unembed.hook_out")
            ]

    record(model, batch, [Spy()])
    assert "unembed.hook_out" not in seen and names.resid_post(model.n_layers - 1) in seen
    seen.clear()
    record(model, batch, [Spy()], last_layer=0)
    assert seen == []  # stopped at the input of block 1


def test_chunked_scans_equal_one_padded_forward(tiny_nobos, batch):
    """Every probe, chunked (tiny chunks) and unchunked (a no-op intervention forces one forward)."""
    model = tiny_nobos
    noop = [(names.resid_pre(0), lambda x, hook: x)]
    ref = [2, 0, 1, 4, 0, 3]
    pairs = [
        (scan_norms(model, batch), scan_norms(model, batch, extra_hooks=noop)),
    ]
    for got, want in pairs:
        torch.testing.assert_close(got.norms, want.norms, equal_nan=True, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.median_abs, want.median_abs, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got.kept_resid, want.kept_resid, rtol=1e-5, atol=1e-5)

    rec = [
        NormRecorder(model, batch),
        AlignmentRecorder(model, batch),
        FFNRecorder(model, batch),
        FFNAtRecorder(model, batch, ref),
        AttentionRecorder(model, batch),
        GeometryRecorder(model, batch, ref),
    ]
    record(model, batch, rec, max_tokens=10)  # several probes in one chunked forward
    al = alignment_scan(model, batch, positions=ref, fwd_hooks=noop)
    got_al = rec[1].result(ref)
    for s in al.sites:
        for m in ("weight_norm", "frac", "kl"):
            torch.testing.assert_close(
                getattr(got_al.sites[s], m),
                getattr(al.sites[s], m),
                equal_nan=True,
                rtol=1e-4,
                atol=1e-5,
            )
    fs = ffn_scan(model, batch, positions=ref, fwd_hooks=noop)
    got_fs = make_scan(rec[2], rec[3])
    for stage in fs.conc:
        torch.testing.assert_close(got_fs.delta_c(stage), fs.delta_c(stage), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_fs.act_at_ref, fs.act_at_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_fs.magnification(), fs.magnification(), rtol=1e-4, atol=1e-5)
    ap = attention_probe(model, batch, reference=ref, fwd_hooks=noop)
    got_ap = rec[4].probe(reference=ref)
    for key in ("to_ref", "entropy", "bos"):
        torch.testing.assert_close(getattr(got_ap, key), getattr(ap, key), rtol=1e-4, atol=1e-5)
    gs = geometry_scan(model, batch, positions=ref, fwd_hooks=noop)
    for m, per in gs.values.items():
        for t in per:
            torch.testing.assert_close(
                rec[5].values[m][t], per[t], rtol=1e-4, atol=1e-5, equal_nan=True
            )


def test_recorders_at_positions_read_the_same_values_from_prefixes(tiny_nobos, batch):
    model = tiny_nobos
    ref = [2, 0, 1, 4, 0, 3]
    full = InvarianceRecorder(model, batch, ref)
    record(model, batch, [full])
    prefix = InvarianceRecorder(model, batch, ref)
    at = FFNAtRecorder(model, batch, ref)
    record(model, batch, [prefix, at], upto=[r + 1 for r in ref])
    torch.testing.assert_close(prefix.states, full.states, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(prefix.keys, full.keys, rtol=1e-5, atol=1e-5)
    whole = ffn_scan(model, batch, positions=ref)
    torch.testing.assert_close(at.act, whole.act_at_ref, rtol=1e-5, atol=1e-5)
    # invariance_scan itself runs on prefixes
    scan = invariance_scan(model, batch, positions=ref)
    torch.testing.assert_close(scan.states, full.states, rtol=1e-5, atol=1e-5)


def test_running_some_rows_only_rewrites_those_rows(tiny_nobos, batch):
    model = tiny_nobos
    geo = GeometryRecorder(model, batch)  # without position 0
    record(model, batch, [geo])
    before = {m: {t: v.clone() for t, v in per.items()} for m, per in geo.values.items()}
    geo.reference = torch.tensor([0, 0, 2, 0, 0, 1])
    record(model, batch, [geo], rows=[2, 5])
    want = geometry_scan(model, batch, positions=geo.reference.tolist())
    for m in geo.values:
        torch.testing.assert_close(geo.values[m]["all"], before[m]["all"], equal_nan=True)
        others = geo.values[m]["others"]
        kept = [0, 1, 3, 4]
        torch.testing.assert_close(others[:, kept], before[m]["others"][:, kept], equal_nan=True)
        torch.testing.assert_close(
            others, want.values[m]["others"], rtol=1e-5, atol=1e-6, equal_nan=True
        )


def test_interventions_run_unchunked_and_cannot_take_rows(tiny_nobos, batch):
    shapes = []

    def spy(x, hook):
        shapes.append(tuple(x.shape[:2]))
        return x

    record(
        tiny_nobos, batch, [NormRecorder(tiny_nobos, batch)], fwd_hooks=[(names.resid_pre(0), spy)]
    )
    assert shapes == [tuple(batch.tokens.shape)]
    with pytest.raises(ValueError, match="fwd_hooks"):
        record(tiny_nobos, batch, [], rows=[0], fwd_hooks=[(names.resid_pre(0), spy)])


def test_resid_mid_recorder_keeps_every_real_token_of_every_layer(tiny_nobos, batch, capture):
    """Chunk by chunk (small chunks: several forwards), the kept resid_mid of every layer is the one
    of one plain padded forward at every real token."""
    model = tiny_nobos
    rec = ResidMidRecorder(model, batch)
    record(model, batch, [rec], max_tokens=12)
    assert rec.out.shape == (model.n_layers, *batch.tokens.shape, model.d_model)
    assert rec.out.dtype == model.dtype
    acts = capture(model, batch, {L: names.resid_mid(L) for L in range(model.n_layers)})
    for L in range(model.n_layers):
        for b, n in enumerate(batch.lengths):
            torch.testing.assert_close(
                rec.out[L, b, :n].float(), acts[L][b, :n], rtol=1e-5, atol=1e-5
            )
