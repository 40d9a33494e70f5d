"""weight_input_cross: the cross matrix against a hand computation from raw weights, the cells the
planted construction makes large (computed from the plant), "not applicable" / "fails" on models
without the mechanism, CLI smoke, and the bundled model with two-sided bounds. On the sandwich-norm
Gemma 2/3 the FFN path ends with the post-FFN norm, so the diagonal reproduces hook_mlp_out; on
Llama the path is the pre-norm and the FFN, exactly as before."""

from __future__ import annotations

import json
from functools import partial

import numpy as np
import pytest
import torch

from me_interp import claims, io, load_model, names, synthetic
from me_interp.claims import FAILS, HOLDS, INCONCLUSIVE, NOT_APPLICABLE, NotApplicable
from me_interp.experiments import weight_input_cross as wic
from me_interp.probes.cross import ffn_path, prompt_statistics
from me_interp.study import RunHeader, roundtrip

PLANTED = {  # the 8-layer planted model with ME layer 6: 6 earlier inputs, 6 large cells
    "weight_input_cross.row_share": HOLDS,
    "weight_input_cross.row_breadth": HOLDS,
    "weight_input_cross.diagonal": HOLDS,  # sanity
}
# ME layer 2 (the 5-layer planted models): 2 of 2 earlier inputs / large cells is [0.16, 1]
PLANTED_FEW = {
    "weight_input_cross.row_share": INCONCLUSIVE,
    "weight_input_cross.row_breadth": INCONCLUSIVE,
    "weight_input_cross.diagonal": HOLDS,
}


def _judge(res):
    return claims.judge(wic.SPECS, res)


def _load(**kw):
    hf, tok, plant = synthetic.planted_llama(**kw)
    return load_model(hf, tokenizer=tok, device="cpu"), plant


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "planted.txt"
    path.write_text("\n".join(synthetic.planted_prompts(5)) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def planted_result(planted, prompt_file):
    return wic.run(wic.Config(prompts=prompt_file), planted[0])


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def sandwich(request, prompt_file):
    """(LoadedModel, Plant, Result) of a planted tiny Gemma 2 / Gemma 3."""
    hf, tok, plant = synthetic.planted(request.param)
    model = load_model(hf, tokenizer=tok, device="cpu")
    return model, plant, wic.run(wic.Config(prompts=prompt_file), model)


def _grab(x, hook, *, store, key):
    store[key] = x.detach().clone()
    return x


def _hand_ffn_path(model, layer: int, h: torch.Tensor) -> torch.Tensor:
    """RMSNorm (h / sqrt(mean h² + eps) ⊙ w) then SwiGLU, from the raw weights (Llama convention)."""
    w = model.ffn_norm_gain(layer).detach()
    x = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + model.norm_eps()) * w
    f = model.ffn_weights(layer)
    act = torch.nn.functional.silu(x @ f.gate.detach().T) * (x @ f.up.detach().T)
    return act @ f.down.detach().T


def test_cross_matches_hand_computation(planted, planted_result):
    """C_b[X, Y] rebuilt from hooked resid_mid / hook_mlp_out and hand-written norm + FFN; the
    diagonal equals the actual FFN output ratio of the massive token."""
    model, _ = planted
    res = planted_result
    batch = model.tokenize(synthetic.planted_prompts(5))
    store: dict = {}
    hooks = []
    for L in range(model.n_layers):
        hooks.append((names.resid_mid(L), partial(_grab, store=store, key=("mid", L))))
        hooks.append((names.ffn_out(L), partial(_grab, store=store, key=("out", L))))
    model.run_with_hooks(batch, hooks)
    mask = batch.attention_mask.bool()
    L = model.n_layers
    for b, p in enumerate(res.positions):
        others = [t for t in range(int(mask[b].sum())) if t != p]
        want = np.zeros((L, L))
        for x in range(L):
            den = store[("out", x)][b, others].norm(dim=-1).median()
            actual = store[("out", x)][b, p].norm()
            for y in range(L):
                want[x, y] = float(_hand_ffn_path(model, x, store[("mid", y)][b, p]).norm() / den)
            assert res.cross[b][x][x] == pytest.approx(float(actual / den), rel=1e-4)
        np.testing.assert_allclose(np.asarray(res.cross[b]), want, rtol=1e-4)


def test_planted_cross_is_large_exactly_where_the_construction_says(planted, planted_result):
    """Layer 2's pair reads the gain dims (3, 11): the BOS token carries 1.0 there at every depth, and
    nothing writes the massive dim 7 before layer 2's FFN. So for inputs Y ≤ 2 the planted neuron gets
    s = Σ_{i∈G} w_i r_i / rms(r) = 2 · 8 / rms(r_Y) and writes down_scale · silu(s) · s into dim 7; for
    Y > 2 the input already holds that value on dim 7, rms(r) is huge and s ≈ 0. No other row has the
    neuron. Large cells: (2, 0), (2, 1), (2, 2) and nothing else."""
    model, plant = planted
    res = planted_result
    m = plant.layer
    assert res.layer == m and res.header.me_layer == m and res.positions == [0] * 5
    batch = model.tokenize(synthetic.planted_prompts(5))
    store: dict = {}
    hooks = [
        (names.resid_mid(y), partial(_grab, store=store, key=y)) for y in range(model.n_layers)
    ]
    hooks += [(names.ffn_out(m), partial(_grab, store=store, key="out"))]
    model.run_with_hooks(batch, hooks)
    for b in range(len(batch)):
        others = store["out"][b, 1 : batch.lengths[b]].norm(dim=-1).median()
        for y in range(model.n_layers):
            r = store[y][b, 0]
            if y <= m:
                assert r[plant.massive_dim] == 0 and torch.all(r[list(plant.gain_dims)] == 1)
                s = len(plant.gain_dims) * plant.gain / torch.sqrt(r.pow(2).mean() + 1e-6)
                neuron = plant.down_scale * torch.nn.functional.silu(s) * s
                assert res.cross[b][m][y] * float(others) == pytest.approx(float(neuron), rel=1e-2)
            else:
                assert abs(r[plant.massive_dim]) > 100
                assert res.cross[b][m][y] < res.large_factor
    assert res.large_cells() == [(m, 0), (m, 1), (m, 2)]
    pp = res.stats
    assert pp.share == [1.0] * 5 and pp.breadth == [1.0] * 5
    assert all(n == 2 for n in pp.n_large_in_region)  # (2, 0) and (2, 1); (2, 2) is left out
    assert res.majority_cells() == [(m, 0), (m, 1), (m, 2)]


def test_planted_verdicts_and_result(planted_result):
    res = planted_result
    cs = _judge(res)
    assert [c.id for c in cs] == [s.id for s in wic.SPECS]
    assert {c.id: c.verdict for c in cs} == PLANTED_FEW
    by = {c.id: c for c in cs}
    assert by["weight_input_cross.diagonal"].kind == "sanity"
    assert by["weight_input_cross.diagonal"].estimate.unit == "prompts"
    share = by["weight_input_cross.row_share"]
    assert share.estimate.unit == "large cells" and share.estimate.n == 2
    assert share.outcomes == {"cell (2, 0) = (m, m-2)": True, "cell (2, 1) = (m, m-1)": True}
    assert share.threshold == claims.threshold("cross_share")
    breadth = by["weight_input_cross.row_breadth"]
    assert breadth.outcomes == {"layer 0 (m-2)": True, "layer 1 (m-1)": True}
    assert breadth.estimate.lo == pytest.approx(0.025**0.5)
    assert breadth.threshold == claims.threshold("cross_breadth")
    d = io.to_jsonable(res)
    assert len(d["stats"]["share"]) == 5
    assert res.majority_cells() == [(2, 0), (2, 1), (2, 2)]
    assert np.asarray(d["cross"]).shape == (5, 5, 5)
    json.dumps(d, allow_nan=False)
    back = roundtrip(res)
    assert io.to_jsonable(back) == d and _judge(back) == cs
    assert set(wic.figures(res)) == {"cross_matrix", "me_row"}
    assert "median over prompts of C[X, Y]" in wic.summary(res)


def test_planted_with_enough_earlier_inputs(prompt_file):
    """ME layer 6 of 8: six earlier inputs, all large in row 6 only: 6 of 6 is [0.54, 1]."""
    model, plant = _load(layer=6, n_layers=8)
    res = wic.run(wic.Config(prompts=prompt_file), model)
    assert res.layer == 6
    cs = {c.id: c for c in _judge(res)}
    assert {i: c.verdict for i, c in cs.items()} == PLANTED
    assert cs["weight_input_cross.row_breadth"].estimate.n == 6
    assert list(cs["weight_input_cross.row_breadth"].outcomes) == [
        f"layer {y} (m{y - 6})" for y in range(6)
    ]


def test_me_layer_at_the_last_layer(prompt_file):
    """Nothing of the cross needs a later layer: the plant at the last layer is judged like any."""
    model, plant = _load(layer=4)
    res = wic.run(wic.Config(prompts=prompt_file), model)
    assert res.layer == 4 and res.majority_cells(4) == [(4, y) for y in range(5)]
    cs = {c.id: c for c in _judge(res)}
    assert cs["weight_input_cross.row_breadth"].estimate.value == 1
    assert cs["weight_input_cross.diagonal"].verdict == HOLDS
    assert wic.summary(res) and wic.figures(res)


def test_outcomes_by_hand():
    """Majority cells, breadth and share outcomes from a hand-made 3-prompt, 4-layer cross, m = 2:
    a cell counts when it is large on at least 2 of the 3 prompts."""
    c = np.ones((3, 4, 4))
    c[:, 2, 2] = 1000.0  # the observed massive output: large bound 100 on every prompt
    c[:, 2, 0] = [500.0, 500.0, 1.0]  # large on 2 of 3: counts
    c[:, 2, 1] = [500.0, 1.0, 1.0]  # large on 1 of 3: does not
    c[:, 1, 0] = [200.0, 200.0, 200.0]  # another row, in the judged region
    c[:, 0, 3] = [200.0, 200.0, 200.0]  # input Y = 3 > m: outside the judged region
    header = RunHeader("m", "b", "built-in", 3, 0, layer=2, layer_given=True, me_layer=2)
    res = wic.result_of(header, 4, [0] * 3, [4] * 3, c.tolist(), 10.0, 0.1)
    assert res.stats.large_count[2][:2] == [2, 1]
    assert res.majority_cells() == [(0, 3), (1, 0), (2, 0), (2, 2)]
    b = res.breadth_outcomes()
    assert list(b.outcomes) == [True, False] and list(b.labels) == [
        "layer 0 (m-2)",
        "layer 1 (m-1)",
    ]
    sh = res.share_outcomes()  # (1, 0) and (2, 0); (2, 2) left out, (0, 3) outside
    assert list(sh.outcomes) == [False, True]
    assert list(sh.labels) == ["cell (1, 0) = (m-1, m-2)", "cell (2, 0) = (m, m-2)"]
    cs = {x.id: x for x in _judge(res)}
    assert cs["weight_input_cross.row_share"].estimate.value == 0.5
    assert cs["weight_input_cross.row_breadth"].estimate.value == 0.5


def test_prompt_statistics_by_hand():
    """A 3-layer cross with m = 2: large = C ≥ max(k, r·C[m, m])."""
    c = np.ones((1, 3, 3))
    c[0, 2, 2] = 1000.0  # the observed massive output
    c[0, 2, 0] = 500.0  # row m, an earlier input: large
    c[0, 1, 1] = 200.0  # another row: large, in the judged region
    c[0, 0, 1] = 50.0  # ≥ k but < r·C[m, m] = 100: not large
    pp = prompt_statistics(c, layer=2, k=10.0, r=0.1)
    assert pp.threshold == [100.0] and pp.diagonal == [1000.0]
    assert pp.share == [0.5] and pp.breadth == [0.5] and pp.n_large_in_region == [2]
    assert pp.large_count == [[0, 0, 0], [0, 1, 0], [1, 0, 1]]
    small = np.ones((1, 3, 3))
    small[0, 2, 2] = 5.0  # below k: nothing is large, so nothing is "in row m"
    pp = prompt_statistics(small, layer=2, k=10.0, r=0.1)
    assert pp.share == [0.0] and pp.breadth == [0.0]


@pytest.mark.parametrize("fixture", ["twin", "tiny_llama"])
def test_without_massive_activation(fixture, request, prompt_file):
    model = request.getfixturevalue(fixture)
    model = model[0] if isinstance(model, tuple) else model
    with pytest.raises(NotApplicable, match="no massive activation on this model"):
        wic.run(wic.Config(prompts=prompt_file), model)
    res = wic.run(wic.Config(prompts=prompt_file, layer=2), model)
    cs = {c.id: c for c in _judge(res)}
    # was: both row claims fail; the share of no large cell is not a share (not applicable), and
    # 0 of 2 earlier inputs is [0, 0.84] (inconclusive; test_fails_on_the_twin has 6 inputs)
    assert "no cell of the judged region" in cs["weight_input_cross.row_share"].why
    assert cs["weight_input_cross.row_breadth"].verdict == INCONCLUSIVE
    assert cs["weight_input_cross.row_breadth"].estimate.value == 0
    assert cs["weight_input_cross.diagonal"].verdict == FAILS  # sanity: no massive output
    assert res.large_cells() == [] == res.majority_cells()


def test_fails_on_the_twin(prompt_file):
    """--layer 6 of the 8-layer twin: no earlier input makes a large cell, 0 of 6 is [0, 0.46]."""
    model, _ = _load(n_layers=8, plant=False)
    cs = {c.id: c for c in _judge(wic.run(wic.Config(prompts=prompt_file, layer=6), model))}
    assert cs["weight_input_cross.row_breadth"].verdict == FAILS
    assert cs["weight_input_cross.row_share"].verdict == NOT_APPLICABLE


def test_layer_zero_has_no_earlier_input(prompt_file):
    hf, tok, _ = synthetic.planted_llama(layer=0)
    res = wic.run(wic.Config(prompts=prompt_file), load_model(hf, tokenizer=tok, device="cpu"))
    assert res.layer == 0
    v = {c.id: c.verdict for c in _judge(res)}
    assert (
        v["weight_input_cross.row_share"] == v["weight_input_cross.row_breadth"] == NOT_APPLICABLE
    )
    assert v["weight_input_cross.diagonal"] == HOLDS


def test_bad_inputs(planted, prompt_file):
    with pytest.raises(ValueError, match="out of range"):
        wic.run(wic.Config(prompts=prompt_file, layer=5), planted[0])
    with pytest.raises(ValueError, match="max_tokens"):
        wic.Config(max_tokens=1)
    with pytest.raises(ValueError, match="criterion"):
        wic.Config(criterion="loud")


def test_cli_smoke_and_help(prompt_file, tmp_path, capsys):
    argv = ["--model", "synthetic:planted", "--prompts", prompt_file, "--out", str(tmp_path)]
    assert wic.main([*argv, "--device", "cpu", "--verbose"]) == 0
    out = capsys.readouterr().out
    assert "[inconclusive] weight_input_cross.row_share" in out
    assert "(sanity check) [holds] weight_input_cross.diagonal" in out
    run_dir = next((tmp_path / wic.NAME).iterdir())
    result = json.loads((run_dir / "result.json").read_text())
    assert result["header"]["layer"] == 2
    assert io.read_result(wic.Result, run_dir).layer == 2
    assert [c["verdict"] for c in result["claims"]] == list(PLANTED_FEW.values())
    assert {p.stem for p in run_dir.glob("*.html")} >= {"cross_matrix", "me_row"}
    assert wic.main([*argv, "--layer", "9"]) == 2
    assert "out of range" in capsys.readouterr().err
    twin = ["--model", "synthetic:twin", "--prompts", prompt_file, "--out", str(tmp_path / "t")]
    assert wic.main(twin) == 0  # not applicable is an answer, not an error
    assert "no massive activation on this model" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        wic.main(["--help"])
    assert e.value.code == 0 and "--max-tokens" in capsys.readouterr().out


@pytest.mark.slow
def test_bundled(bundled):
    """SmolLM2-135M (ME layer 11), 82 built-in prompts cut to 64 tokens: only layer 11's pair makes a
    massive output from pre-emergence inputs (row share holds), but only from layer 10's input — at
    earlier depths it gives ~10-30x an ordinary FFN output, far from the ~700x it makes on its own
    input (row breadth fails). Numbers from docs/weight_experiments.md."""
    res = wic.run(wic.Config(), bundled)
    assert res.layer == res.header.me_layer == 11
    med = res.matrix()
    assert 400 < med[11, 11] < 1500  # measured 732
    assert 80 < med[11, 10] < 400  # measured 189
    assert 5 < med[11, 9] < 60  # measured 21.5
    assert [c for c in res.large_cells() if c[1] <= 11] == [(11, 10), (11, 11)]
    v = {c.id: c for c in _judge(res)}
    share, breadth = v["weight_input_cross.row_share"], v["weight_input_cross.row_breadth"]
    # was: share HOLDS 0.93 [0.75, 1] bootstrapped over prompts and breadth FAILS 0.0909 [0.0909,
    # 0.0909] (issue 17 finding 4); now k of n over large cells / earlier input layers
    assert res.majority_cells(10) == [(11, 10)]
    assert share.verdict == INCONCLUSIVE and share.outcomes == {"cell (11, 10) = (m, m-1)": True}
    assert (
        breadth.verdict == FAILS and breadth.estimate.n == 11 and breadth.estimate.value == 1 / 11
    )
    assert breadth.estimate.hi < 0.5


def _hf_rmsnorm(norm: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    """Gemma's RMSNorm by hand from the HF module's raw weight: h / sqrt(mean h² + eps) ⊙ (1 + w)."""
    return h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps) * (1.0 + norm.weight.detach())


def _hand_gemma_ffn(layer: torch.nn.Module, h: torch.Tensor, post: bool = True) -> torch.Tensor:
    """pre_feedforward_layernorm → GELU-tanh gated FFN → post_feedforward_layernorm, from the HF
    decoder layer's raw weights (``post=False``: stop before the post-norm)."""
    x = _hf_rmsnorm(layer.pre_feedforward_layernorm, h)
    mlp = layer.mlp
    w = {n: getattr(mlp, n).weight.detach() for n in ("gate_proj", "up_proj", "down_proj")}
    act = torch.nn.functional.gelu(x @ w["gate_proj"].T, approximate="tanh") * (x @ w["up_proj"].T)
    out = act @ w["down_proj"].T
    return _hf_rmsnorm(layer.post_feedforward_layernorm, out) if post else out


def test_sandwich_cross_matches_hand_computation_and_hook_mlp_out(sandwich):
    """On Gemma 2/3: C_b[X, Y] from hooked resid_mid / hook_mlp_out and the hand-written pre-norm →
    FFN → post-norm of the HF layer; the diagonal C_b[X, X] equals the actual hook_mlp_out ratio of
    the massive token for every layer X, and leaving the post-norm out would not reproduce it."""
    model, _, res = sandwich
    assert res.path_modules == [
        "pre_feedforward_layernorm",
        "mlp",
        "post_feedforward_layernorm",
    ]
    assert io.to_jsonable(res)["path_modules"] == res.path_modules
    assert wic.FFN_SITE == "ffn_out"
    batch = model.tokenize(synthetic.planted_prompts(5))
    store: dict = {}
    hooks = []
    for L in range(model.n_layers):
        hooks.append((names.resid_mid(L), partial(_grab, store=store, key=("mid", L))))
        hooks.append((names.ffn_out(L), partial(_grab, store=store, key=("out", L))))
    model.run_with_hooks(batch, hooks)
    hf_layers = [model.block_module(x) for x in range(model.n_layers)]
    L = model.n_layers
    worst_without_post = 0.0
    for b, p in enumerate(res.positions):
        others = [t for t in range(batch.lengths[b]) if t != p]
        want = np.zeros((L, L))
        for x in range(L):
            den = store[("out", x)][b, others].norm(dim=-1).median()
            actual = store[("out", x)][b, p].norm()
            assert res.cross[b][x][x] == pytest.approx(float(actual / den), rel=1e-4)
            for y in range(L):
                h = store[("mid", y)][b, p]
                want[x, y] = float(_hand_gemma_ffn(hf_layers[x], h).norm() / den)
            pre_only = float(_hand_gemma_ffn(hf_layers[x], store[("mid", x)][b, p], False).norm())
            worst_without_post = max(worst_without_post, abs(pre_only / float(actual) - 1))
        np.testing.assert_allclose(np.asarray(res.cross[b]), want, rtol=1e-4)
    assert worst_without_post > 0.5  # the FFN's own output is not the residual contribution


def test_sandwich_planted_cross(sandwich):
    """Construction: only layer m has the neuron that writes the massive dim, and every post-FFN norm
    has gain g = 400 there; for inputs Y ≤ m (no massive dim yet) layer m's FFN output is dominated by
    that dim, so its post-norm output is ≈ g·sqrt(d_model) e_massive: C[m, Y] · den ≈ 400 · sqrt(32).
    The other rows stay ordinary (< k), and the claims hold as on the planted Llama."""
    model, plant, res = sandwich
    m = plant.layer
    assert res.layer == res.header.me_layer == m and res.positions == [0] * 5
    cross = np.asarray(res.cross)  # [prompt X Y]
    num_diag = cross[:, m, m]
    for y in range(m + 1):  # the same saturated value from every pre-emergence input
        np.testing.assert_allclose(cross[:, m, y], num_diag, rtol=1e-3)
    post_gain = float(model.arch.gain(model.post_ffn_norm_module(m).weight)[plant.massive_dim])
    assert post_gain == pytest.approx(400.0)
    batch = model.tokenize(synthetic.planted_prompts(5))
    store: dict = {}
    model.run_with_hooks(batch, [(names.ffn_out(m), partial(_grab, store=store, key="out"))])
    for b in range(len(batch)):
        den = float(store["out"][b, 1 : batch.lengths[b]].norm(dim=-1).median())
        assert cross[b, m, 0] * den == pytest.approx(post_gain * model.d_model**0.5, rel=1e-2)
    others = np.delete(cross[:, :, : m + 1], m, axis=1)  # rows X != m, inputs Y <= m
    assert others.max() < res.large_factor
    assert {c.id: c.verdict for c in _judge(res)} == PLANTED_FEW


def test_llama_cross_path_is_the_pre_norm_and_ffn_exactly(planted, planted_result):
    """Without a post-FFN norm the path is RMSNorm_ffn then FFN, bit for bit, and the denominator
    site ffn_out is the FFN's own output (ffn_own) there: Llama results are unchanged."""
    model, _ = planted
    assert planted_result.path_modules == ["post_attention_layernorm", "mlp"]
    h = torch.randn(7, model.d_model) * 3
    for x in range(model.n_layers):
        ref = model.bridge.blocks[x].mlp.original_component(model.ffn_norm_module(x)(h))
        assert torch.equal(ffn_path(model, x, h), ref)
    batch = model.tokenize(synthetic.planted_prompts(2))
    store: dict = {}
    model.run_with_hooks(
        batch,
        [
            (names.ffn_out(1), partial(_grab, store=store, key="out")),
            (names.ffn_own(1), partial(_grab, store=store, key="own")),
        ],
    )
    assert torch.equal(store["out"], store["own"])
