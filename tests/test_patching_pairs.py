"""User pairs and per-head patching: equality with transformer_lens.patching, fixed points, bad input."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from transformer_lens import patching as tl_patching

from me_interp.models import Batch
from me_interp.patching import (
    LOGITS,
    AnswerProb,
    Custom,
    KLToClean,
    LogitDiff,
    evaluate_metrics,
    patch_loop,
    patch_sweep,
)
from me_interp.patching.pairs import Pair, logit_metric, read_pairs, tokenize_pairs

IOI = [
    ("When Mary and John went to the store, John gave a drink to", " Mary", " John"),
    ("When Tom and James went to the park, James gave a ball to", " Tom", " James"),
    ("After Sarah and Emma went to the shop, Emma gave a book to", " Sarah", " Emma"),
    ("When Anna and David went to the bar, David handed a drink to", " Anna", " David"),
]


def _ioi_pairs() -> list[Pair]:
    out = []
    for i, (clean, answer, wrong) in enumerate(IOI, 1):
        a, w = answer.strip(), wrong.strip()
        corrupt = clean.replace(f"{w} gave", "@").replace(f"{w} handed", "#")
        corrupt = corrupt.replace("@", f"{a} gave").replace("#", f"{a} handed")
        out.append(Pair(clean, corrupt, answer, wrong, i))
    return out


@pytest.fixture(scope="module")
def bundled64():
    """The bundled model in float64, so that equality with TransformerLens is tested at 1e-6 free of
    float32 summation-order noise."""
    from me_interp import load_model

    return load_model(device="cpu", dtype=torch.float64)


@pytest.fixture(scope="module")
def ioi(bundled64):
    pb = tokenize_pairs(bundled64, _ioi_pairs())
    assert pb.clean.tokens.shape == pb.corrupt.tokens.shape and not pb.clean.padded
    return bundled64, pb


def _tl(model, pb, fn, metric, index_df=None):
    """transformer_lens.patching on the bridge with the same metric on the last-token logits."""
    bridge = model.bridge
    _, cache = bridge.run_with_cache(pb.clean.tokens)
    mask = pb.corrupt.attention_mask.bool()

    def tl_metric(logits):
        last = logits[torch.arange(len(pb)), mask.sum(-1) - 1]
        return metric({LOGITS: last}, mask)

    kwargs = {"index_df": index_df, "index_axis_names": None} if index_df is not None else {}
    return fn(bridge, pb.corrupt.tokens, cache, tl_metric, reduce="none", **kwargs).values


def _df(**axes) -> pd.DataFrame:
    import itertools

    return pd.DataFrame(list(itertools.product(*axes.values())), columns=list(axes))


LAYERS, HEADS = [3, 20], [0, 7]


def _positions(pb) -> list[int]:
    """The first position where the pairs differ (the second name) and the last one."""
    first = int((pb.clean.tokens != pb.corrupt.tokens).any(0).nonzero()[0, 0])
    return [first, pb.clean.tokens.shape[1] - 1]


@pytest.mark.slow
def test_logit_diff_resid_pre_equals_transformer_lens(ioi):
    model, pb = ioi
    metric = LogitDiff(pb.answer, pb.wrong)
    pos = _positions(pb)
    ours = patch_sweep(
        model, pb.clean, pb.corrupt, "resid_pre", {"ld": metric}, layers=LAYERS, positions=pos
    )
    ref = _tl(model, pb, tl_patching.get_act_patch_resid_pre, metric, _df(layer=LAYERS, pos=pos))
    torch.testing.assert_close(
        ours.values["ld"].reshape(-1, len(pb)), ref.double(), rtol=0, atol=1e-6
    )
    # TL's normalisation at its fixed points: resid_pre of layer 0 at every position is the clean run
    clean_ld = float(ours.clean["ld"].mean())
    assert clean_ld > float(ours.corrupt["ld"].mean())  # the model prefers the indirect object
    full = patch_sweep(
        model, pb.clean, pb.corrupt, "resid_pre", {"ld": metric}, layers=[0], per_position=False
    )
    assert full.cell("ld", 0) == pytest.approx(1.0, abs=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize(
    "site,per_position,tl_fn",
    [
        ("attn_head_out", False, tl_patching.get_act_patch_attn_head_out_all_pos),
        ("attn_head_out", True, tl_patching.get_act_patch_attn_head_out_by_pos),
        ("attn_head_pattern", False, tl_patching.get_act_patch_attn_head_pattern_all_pos),
        ("attn_head_pattern", True, tl_patching.get_act_patch_attn_head_pattern_by_pos),
        ("q", False, tl_patching.get_act_patch_attn_head_q_all_pos),
        ("v", True, tl_patching.get_act_patch_attn_head_v_by_pos),
    ],
)
def test_per_head_logit_diff_equals_transformer_lens(ioi, site, per_position, tl_fn):
    model, pb = ioi
    metric = LogitDiff(pb.answer, pb.wrong)
    heads = [0, 2] if site == "v" else HEADS  # SmolLM2 has 3 key-value heads
    positions = _positions(pb) if per_position else None
    ours = patch_sweep(
        model,
        pb.clean,
        pb.corrupt,
        site,
        {"ld": metric},
        layers=LAYERS,
        positions=positions,
        heads=heads,
        per_position=per_position,
    )
    if not per_position:
        df = (
            _df(layer=LAYERS, head_index=heads)
            if "pattern" in site
            else _df(layer=LAYERS, head=heads)
        )
        got = ours.values["ld"]  # [layer head batch]
    elif site == "attn_head_pattern":  # TL's axes: layer, head, dest_pos
        df = _df(layer=LAYERS, head_index=heads, dest_pos=positions)
        got = ours.values["ld"].permute(0, 2, 1, 3)  # ours: layer, pos, head
    else:
        df = _df(layer=LAYERS, pos=positions, head=heads)
        got = ours.values["ld"]
    ref = _tl(model, pb, tl_fn, metric, df)
    torch.testing.assert_close(got.reshape(-1, len(pb)), ref.double(), rtol=0, atol=1e-6)
    assert ours.axes == ("layer", *(("pos",) if per_position else ()), "head")


def test_batched_head_sweep_equals_one_forward_per_cell(planted):
    """Every cell of a GQA-free tiny model, batched with skipping, against the plain loop."""
    model, _ = planted
    clean = model.tokenize(["w1 w2 w3 w4 w5", "w7 w8 w9 w10 w11"])
    corrupt = Batch(clean.tokens.flip(0), clean.attention_mask.clone())
    metric = {
        "p": AnswerProb(torch.tensor([5, 9])),
        "kl": KLToClean(torch.randn(2, model.bridge.cfg.d_vocab)),
    }
    for site in ("attn_head_out", "attn_head_pattern", "k"):
        for per_pos in (False, True):
            a = patch_sweep(model, clean, corrupt, site, metric, batch_size=7, per_position=per_pos)
            b = patch_loop(model, clean, corrupt, site, metric, per_position=per_pos)
            for k in metric:
                torch.testing.assert_close(a.values[k], b.values[k], rtol=1e-4, atol=1e-6)


def test_kl_and_prob_fixed_points(planted):
    model, _ = planted
    pb = tokenize_pairs(
        model,
        [
            Pair("w1 w2 w3 w4", "w5 w2 w3 w4", "w6", None, 1),
            Pair("w7 w8 w9", "w1 w8 w9", "w2", None, 2),
        ],
    )
    # lengths 4 and 3: right-padded, and every metric reads each pair's last real token
    assert pb.clean.padded and pb.wrong is None
    kl = logit_metric("kl", pb, _last_logits(model, pb.clean))
    vals = evaluate_metrics(model, pb.clean, {"kl": kl, "p": logit_metric("prob", pb)})
    assert torch.allclose(vals["kl"], torch.zeros(2, dtype=torch.float64), atol=1e-6)
    assert ((vals["p"] > 0) & (vals["p"] < 1)).all()
    sw = patch_sweep(
        model, pb.clean, pb.corrupt, "resid_pre", {"kl": kl}, layers=[0], per_position=False
    )
    assert sw.cell("kl", 0) == pytest.approx(1.0, abs=1e-6) and float(sw.corrupt["kl"].mean()) > 0


def _last_logits(model, batch):
    logits = model.run_with_hooks(batch)
    return logits[torch.arange(len(batch)), batch.attention_mask.sum(-1) - 1]


def test_custom_metric_reads_logits_and_activations(planted):
    model, _ = planted
    clean = model.tokenize(["w1 w2 w3 w4 w5"])
    got = evaluate_metrics(
        model,
        clean,
        {
            "c": Custom(
                lambda logits, acts: logits[:, 3] + acts["blocks.1.hook_resid_post"][:, 0, 0],
                reads=("blocks.1.hook_resid_post",),
            )
        },
    )["c"]
    store = {}

    def rec(x, hook):
        store["h"] = x
        return x

    logits = model.run_with_hooks(clean, [("blocks.1.hook_resid_post", rec)])
    assert float(got[0]) == pytest.approx(float(logits[0, -1, 3] + store["h"][0, 0, 0]), rel=1e-5)
    with pytest.raises(ValueError, match="one value per row"):
        evaluate_metrics(model, clean, {"c": Custom(lambda logits, acts: logits)})


# -- bad input ------------------------------------------------------------------------------


def _write(tmp_path, lines) -> str:
    p = tmp_path / "pairs.jsonl"
    p.write_text(
        "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines), encoding="utf-8"
    )
    return str(p)


@pytest.mark.parametrize(
    "lines,match",
    [
        (["{not json"], "line 1: not JSON"),
        ([{"clean": "a b"}], "line 1: 'corrupt' must be a non-empty string"),
        ([{"clean": "a", "corrupt": "b", "answr": "x"}], "line 1: unknown keys"),
        ([{"clean": "a", "corrupt": "b"}, "[1, 2]"], "line 2: expected a JSON object"),
        ([{"clean": "a", "corrupt": "b", "answer": 3}], "'answer' must be a string"),
        (["", "  "], "holds no pairs"),
    ],
)
def test_read_pairs_names_the_line(tmp_path, lines, match):
    with pytest.raises(ValueError, match=match):
        read_pairs(_write(tmp_path, lines))


def test_pairs_of_different_lengths_and_long_answers_are_refused(planted):
    model, _ = planted
    with pytest.raises(ValueError, match="line 7: clean and corrupt tokenise to different lengths"):
        tokenize_pairs(model, [Pair("w1 w2 w3", "w1 w2", line=7)])
    with pytest.raises(ValueError, match="line 3: answer 'w1 w2' is 2 tokens"):
        tokenize_pairs(model, [Pair("w1 w2", "w3 w2", "w1 w2", None, 3)])
    pb = tokenize_pairs(model, [Pair("w1 w2", "w3 w2", "w1", None, 4)])
    with pytest.raises(ValueError, match="logit_diff needs 'wrong' on every pair; line 4"):
        logit_metric("logit_diff", pb)
    with pytest.raises(ValueError, match="unknown logit metric"):
        logit_metric("loss", pb)


def test_head_arguments_are_checked(planted):
    model, _ = planted
    clean = model.tokenize(["w1 w2 w3"])
    m = {"p": AnswerProb(torch.tensor([1]))}
    with pytest.raises(ValueError, match="heads are only for the per-head sites"):
        patch_sweep(model, clean, clean, "resid_pre", m, heads=[0])
    with pytest.raises(ValueError, match="head 99 out of range"):
        patch_sweep(model, clean, clean, "attn_head_out", m, heads=[99])
    with pytest.raises(ValueError, match="give no positions"):
        patch_sweep(model, clean, clean, "attn_head_out", m, positions=[0], per_position=False)


# -- attribution patching ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny64():
    from me_interp import load_model, synthetic

    hf, tok = synthetic.tiny_llama()
    return load_model(hf, tokenizer=tok, device="cpu", dtype=torch.float64)


@pytest.mark.parametrize(
    "site,per_position",
    [("resid_pre", True), ("attn_head_out", False), ("mlp_out", True), ("attn_head_pattern", True)],
)
def test_attribution_is_exact_to_first_order(tiny64, site, per_position):
    """A corruption of size ε (a fixed random direction added to layer 1's input): exact patching
    moves each metric by O(ε) and the attribution estimate misses it by O(ε²) — an independent
    check of the gradients and of which elements each cell sums. Measured: at ε = 1e-2 the miss is
    up to 9 % of the move, at ε = 1e-3 up to 0.9 % (first-order, as it must be), apart from moves
    near the float32 floor of the bridge's softmax."""
    from me_interp import names
    from me_interp.patching import attribution_sweep

    model = tiny64
    batch = model.tokenize(["w1 w2 w3 w4 w5", "w7 w8 w9 w10 w11"])
    eps = 1e-3
    noise = torch.randn(
        batch.tokens.shape[1], model.d_model, generator=torch.Generator().manual_seed(0)
    )

    def shift(x, hook):
        return x + eps * float(x.detach().norm(dim=-1).mean()) * noise.to(x.dtype)

    last = model.n_layers - 1
    out, pat = names.resid_post(last), names.pattern(last)
    metrics = {
        "norm": Custom(
            lambda logits, a: a[out][:, 0].double().norm(dim=-1), reads=(out,), logits=False
        ),
        "sink": Custom(
            lambda logits, a: a[pat][:, :, 1:, 0].double().mean((1, 2)), reads=(pat,), logits=False
        ),
        "logit": Custom(lambda logits, a: logits[:, 3].double() - logits[:, 5].double()),
    }
    kw = {"per_position": per_position, "corrupt_hooks": [(names.resid_pre(1), shift)]}
    exact = patch_sweep(model, batch, batch, site, metrics, skip_shared=False, **kw)
    attr = attribution_sweep(model, batch, batch, site, metrics, **kw)
    assert attr.method == "attribution" and attr.values["norm"].shape == exact.values["norm"].shape
    moved = {k: float((exact.values[k] - exact.corrupt[k]).abs().max()) for k in metrics}
    assert max(moved.values()) > 1e-6  # the patches do move the metrics
    for k in metrics:
        err = float((attr.values[k] - exact.values[k]).abs().max())
        assert err <= 0.05 * moved[k] + 1e-9, (k, err, moved[k])
        # below the corruption hook clean and corrupt are equal: no backward there, exactly 0
        assert float((attr.values[k][0] - attr.corrupt[k].double().cpu()).abs().max()) == 0.0


def test_rank_agreement_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    from me_interp.patching import SweepResult, rank_agreement

    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(4, 5, 3)), rng.normal(size=(4, 5, 3))
    a[0, 0] = a[0, 1]  # a tie

    def sw(v):
        z = torch.zeros(3, dtype=torch.float64)
        return SweepResult(
            "resid_pre",
            [0, 1, 2, 3],
            [0, 1, 2, 3, 4],
            {"m": torch.tensor(v)},
            {"m": z + 1},
            {"m": z},
        )

    want = stats.spearmanr(a.mean(-1).ravel(), b.mean(-1).ravel()).statistic
    assert rank_agreement(sw(a), sw(b), "m") == pytest.approx(want, abs=1e-12)
