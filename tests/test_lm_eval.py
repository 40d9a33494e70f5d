"""WeMask in lm-evaluation-harness (me_interp.lm_eval, me_interp.tasks)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from me_interp.lm_eval import WeMaskLM, main, parse_layers, parse_positions  # noqa: E402
from me_interp.tasks import TASK_DIR, TASKS  # noqa: E402

N_ITEMS = 6


def _evaluate(lm, limit=N_ITEMS):
    import lm_eval
    from lm_eval.tasks import TaskManager

    res = lm_eval.simple_evaluate(
        model=lm, tasks=["me_interp_mc"], limit=limit, log_samples=True,
        task_manager=TaskManager(include_path=str(TASK_DIR)), bootstrap_iters=0,
    )  # fmt: skip
    samples = sorted(res["samples"]["me_interp_mc"], key=lambda s: s["doc_id"])
    return res, samples


@pytest.fixture(scope="module")
def masked_lm():
    lm = WeMaskLM(rate=0.1, variant="weight", dtype="float32", device="cpu", batch_size=8)
    yield lm
    lm.remove_hooks()


@pytest.mark.slow
def test_lm_eval_accuracy_equals_me_interp_scoring(bundled, masked_lm):
    """lm-eval's log-likelihood accuracy under the mask = me_interp's own MC scoring under the same
    mask (TransformerLens hooks on the bridge), item by item; and the mask changes the scores."""
    from me_interp.evaluation import load_mc_items, score_choices
    from me_interp.interventions import we_mask
    from me_interp.interventions.wemask import me_layer_index

    me = me_layer_index(bundled)
    info = masked_lm.get_model_info()["me_interp"]
    assert info["me_layer"] == me and info["me_layer_source"] == "measured"
    assert info["layers"] == list(range(me, bundled.n_layers)) and info["n_dims"] == 58
    items = load_mc_items()[:N_ITEMS]
    ours = score_choices(bundled, items, we_mask(bundled, 0.1, "weight", me_layer=me))
    res, samples = _evaluate(masked_lm)
    assert res["config"]["me_interp"]["layers"] == info["layers"]  # recorded in the results
    ll = [[r[0][0] for r in s["resps"]] for s in samples]
    assert [max(range(len(x)), key=x.__getitem__) for x in ll] == ours.predictions
    assert [bool(s["acc"]) for s in samples] == ours.correct
    assert res["results"]["me_interp_mc"]["acc,none"] == pytest.approx(ours.accuracy, abs=0)
    torch.testing.assert_close(torch.tensor(ll), torch.tensor(ours.loglik), atol=2e-3, rtol=0)
    # the masked edits happened, one first token per request row, in every masked layer
    st = masked_lm.hooks.stats
    assert set(st) == set(info["layers"]) and all(v["edited_tokens"] > 0 for v in st.values())

    plain = WeMaskLM(intervention="none", dtype="float32", device="cpu", batch_size=8)
    assert plain.hooks is None
    _, base = _evaluate(plain)
    base_ll = torch.tensor([[r[0][0] for r in s["resps"]] for s in base])
    unmasked = score_choices(bundled, items)
    torch.testing.assert_close(base_ll, torch.tensor(unmasked.loglik), atol=2e-3, rtol=0)
    assert (base_ll - torch.tensor(ll)).abs().max() > 0.05  # the mask moves the log-likelihoods


def test_generate_until_left_padding_edits_first_real_token_once():
    """generate_until pads left and decodes with a KV cache: every masked layer edits exactly one
    token per row, the row's first real token, at prefill, and nothing at decode steps."""
    lm = WeMaskLM(pretrained="synthetic:planted", me_layer=2, rate=0.5, device="cpu", batch_size=4)
    spec = lm.hooks.specs[0]
    calls: list[tuple[int, tuple, list]] = []
    edit = spec.edit

    def recording(h, layer, target, resid):
        calls.append((layer, tuple(target.shape), target.nonzero().tolist()))
        return edit(h, layer, target, resid)

    object.__setattr__(spec, "edit", recording)  # the registered hooks call spec.edit
    prompts = ["w1 w2 w3 w4 w5", "w6 w7", "w8 w9 w10", "w11"]
    reqs = [
        Instance("generate_until", {}, (p, {"until": ["w59"], "max_gen_toks": 3}), i)
        for i, p in enumerate(prompts)
    ]
    out = lm.generate_until(reqs)
    assert len(out) == len(prompts)
    layers = lm.wemask_settings["layers"]
    assert layers == [2, 3, 4]
    lengths = sorted((len(lm.tok_encode(p)) for p in prompts), reverse=True)  # lm-eval's order
    width = max(lengths)
    prefill = [c for c in calls if c[1][1] > 1]
    decode = [c for c in calls if c[1][1] == 1]
    assert sorted(c[0] for c in prefill) == layers  # one prefill per masked layer
    assert len(decode) == 2 * len(layers) and all(c[2] == [] for c in decode)  # 3 tokens
    for _, shape, idx in prefill:
        assert shape == (len(prompts), width)
        assert idx == [[b, width - n] for b, n in enumerate(lengths)]  # first real token per row
    assert any(width - n > 0 for n in lengths)  # some rows are left-padded
    lm.remove_hooks()
    assert not lm.hooks.active


def test_task_configs_load_local_data():
    from lm_eval.tasks import TaskManager, get_task_dict

    tm = TaskManager(include_path=str(TASK_DIR))
    assert set(TASKS) <= set(tm.all_tasks)
    tasks = get_task_dict(list(TASKS), tm)
    sizes = {name: len(list(t.test_docs())) for name, t in tasks.items()}
    assert sizes == {
        "me_interp_mc": 64, "me_interp_gsm8k": 1319, "me_interp_aime25": 30,
        "me_interp_humaneval": 164,
    }  # fmt: skip
    mc = next(iter(tasks["me_interp_mc"].test_docs()))
    assert mc["choices"][0].startswith(" ") and 0 <= mc["answer"] < len(mc["choices"])


def test_task_metrics():
    from me_interp.tasks import utils

    assert utils.final_integer("so the answer is \\boxed{70}.") == "70"
    assert utils.final_integer("it is 1,024 or 3") == "3"
    assert utils.final_integer("no number") is None
    doc = {"answer": "070"}
    assert utils.aime_process_results(doc, ["\\boxed{70}"]) == {"exact_match": 1}
    assert utils.aime_process_results(doc, ["71"]) == {"exact_match": 0}
    he = next(iter(utils.humaneval()["test"]))
    assert utils.humaneval_process_results(he, [he["canonical_solution"]]) == {"pass@1": 1.0}
    assert utils.humaneval_process_results(he, ["    return None\n"]) == {"pass@1": 0.0}


def test_parse_settings():
    assert parse_layers("auto") == "auto"
    assert parse_layers("3-5") == (3, 4, 5)
    assert parse_layers("3|7") == (3, 7)
    assert parse_layers(4) == (4,)
    assert parse_positions("first") == (0,) and parse_positions("0|3") == (0, 3)
    for bad in ("5-3", "a|b", True):
        with pytest.raises(ValueError, match="layers"):
            parse_layers(bad)
    with pytest.raises(ValueError, match="massive"):
        parse_positions("massive")
    with pytest.raises(ValueError, match=">= 0"):
        parse_positions("-1")


@pytest.mark.parametrize(
    "kw, match",
    [({"intervention": "bogus"}, "intervention"), ({"variant": "bogus"}, "variant"),
     ({"rate": 1.5}, "rate"), ({"alpha": -0.1}, "alpha"), ({"start": "le"}, "start")],
)  # fmt: skip
def test_bad_settings_fail_before_loading(kw, match):
    with pytest.raises(ValueError, match=match):
        WeMaskLM(pretrained="does/not/exist", **kw)


def test_cli_help(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "me_interp" in out and "--model_args" in out
