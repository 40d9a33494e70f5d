"""The shipped inputs: built-in prompts, perplexity texts and multiple-choice items.

Fast tests check counts, formats and the MC schema; ``slow`` ones measure token lengths and first tokens
with the bundled SmolLM2 tokenizer, the one the experiments use by default.
"""

from __future__ import annotations

import copy
import json
import pickle
import statistics
import warnings
from collections import Counter
from importlib import resources

import pytest

from me_interp import evaluation, prompts

MC_KEYS = {"context", "choices", "answer"}


def _mc_raw() -> list[dict]:
    return json.loads(resources.files("me_interp.data").joinpath(evaluation.MC_FILE).read_text())


# ------------------------------------------------------------------------------------------
# prompts
# ------------------------------------------------------------------------------------------


def test_builtin_prompts_count_and_genres():
    ps, genres = prompts.builtin_prompts(), prompts.builtin_genres()
    assert len(ps) >= 72
    assert len(genres) == len(ps)
    counts = Counter(genres)
    assert set(counts) == set(prompts.GENRES)  # every genre present
    assert counts["non-english"] >= 5
    assert counts["code"] >= 8
    assert all(p == p.strip() and p for p in ps)


def test_builtin_prompts_prefixes_are_varied_and_short():
    """Experiments that subsample take the first n prompts: any prefix mixes genres and stays cheap."""
    ps, genres = prompts.builtin_prompts(), prompts.builtin_genres()
    assert set(genres[: len(prompts.GENRES)]) == set(prompts.GENRES)
    assert max(len(p) for p in ps[:24]) <= 300  # the long (> 150-token) prompts come later
    assert max(len(p) for p in ps) > 900  # ... but they are there


def test_builtin_prompts_first_words_differ():
    ps = prompts.builtin_prompts()
    firsts = [p.split()[0] for p in ps]
    assert len(set(firsts)) == len(ps)


def test_builtin_prompts_round_trip_through_a_prompt_file(tmp_path):
    """Writing the set with the ``\\n`` convention and reading it back gives the same prompts."""
    ps = prompts.builtin_prompts()
    assert any("\n" in p for p in ps)  # multi-line prompts (code, dialogue) are there
    path = tmp_path / "p.txt"
    path.write_text("\n".join(p.replace("\n", "\\n") for p in ps) + "\n", encoding="utf-8")
    assert prompts.read_prompts(path) == ps
    (tmp_path / "p.json").write_text(json.dumps(ps), encoding="utf-8")
    assert prompts.read_prompts(tmp_path / "p.json") == ps


def test_builtin_texts():
    texts = prompts.builtin_texts()
    assert len(texts) >= 40
    assert len(set(texts)) == len(texts)
    # wemask reads the file with plain splitlines(): keep both readings identical
    raw = resources.files("me_interp.data").joinpath(prompts.TEXTS_FILE).read_text("utf-8")
    assert texts == [t for t in raw.splitlines() if t.strip()]


def test_prompt_stats_matches_a_manual_count(tiny_llama):
    """On the word tokenizer (which prepends BOS) every prompt starts with BOS: one first token."""
    ps = ["w4 w5 w6", "w7 w8", "w9 w10 w11 w12 w13"]
    st = prompts.prompt_stats(tiny_llama, ps)
    assert st.lengths == [len(tiny_llama.tokenizer(p)["input_ids"]) for p in ps] == [4, 3, 6]
    assert (st.n, st.n_first_tokens, st.min_tokens, st.max_tokens) == (3, 1, 3, 6)
    assert st.median_tokens == 4.0 and st.mean_tokens == pytest.approx(13 / 3)
    assert (st.total_tokens, st.padded_tokens) == (13, 18)
    assert st.genres == {}
    assert set(st.to_dict()) >= {"n", "lengths", "genres"}


# ------------------------------------------------------------------------------------------
# short prompts: dropped in one place (LoadedModel.tokenize), with a note
# ------------------------------------------------------------------------------------------


def test_prompt_is_a_str_that_keeps_its_index():
    p = prompts.Prompt("w4 w5", 7)
    assert p == "w4 w5" and isinstance(p, str) and p.index == 7
    assert json.loads(json.dumps([p])) == ["w4 w5"]
    back = pickle.loads(pickle.dumps(p))
    assert isinstance(back, prompts.Prompt) and back.index == 7 and back == p
    assert copy.deepcopy(p).index == 7
    ps = prompts.as_prompts(["a", "b c"])
    assert [(q, q.index) for q in ps] == [("a", 0), ("b c", 1)]
    assert [q.index for q in prompts.spread(prompts.as_prompts(list("abcdef")), 3)] == [0, 2, 5]


def test_load_prompts_gives_prompts(tmp_path):
    from me_interp.study import CommonConfig

    path = tmp_path / "p.txt"
    path.write_text("w4 w5\nw6\n")
    got = CommonConfig(prompts=str(path)).load_prompts()
    assert got == ["w4 w5", "w6"] and all(isinstance(p, prompts.Prompt) for p in got)
    assert [p.index for p in got] == [0, 1]
    assert len(CommonConfig().load_prompts()) == len(prompts.builtin_prompts())


def test_tokenize_drops_short_prompts_only(tiny_qwen3):
    """Without BOS a one-word prompt is one token: an experiment prompt is dropped with a warning and
    recorded; the same string as a plain str (a text, an MC context) keeps its row."""
    model = tiny_qwen3
    ps = prompts.as_prompts(["w4 w5 w6", "w7", "w8 w9", "w10"])
    with pytest.warns(UserWarning, match=r"dropped 2 of 4 prompts .* indices \[1, 3\]\); 2 kept"):
        batch = model.tokenize(ps)
    assert batch.prompts == ("w4 w5 w6", "w8 w9") and batch.lengths == [3, 2]
    assert batch.tokens[1, :2].tolist() == model.tokenize("w8 w9").tokens[0].tolist()
    assert model.prompt_filter == {
        "min_tokens": 2,
        "n_given": 4,
        "n_kept": 2,
        "dropped": [
            {"index": 1, "prompt": "w7", "tokens": 1},
            {"index": 3, "prompt": "w10", "tokens": 1},
        ],
    }
    plain = model.tokenize([str(p) for p in ps])
    assert plain.lengths == [3, 1, 2, 1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing short: no warning, and the record says so
        model.tokenize(prompts.as_prompts(["w4 w5", "w6 w7"]))
    assert model.prompt_filter["n_kept"] == 2 and model.prompt_filter["dropped"] == []
    with pytest.raises(ValueError, match="every one of the 2 prompts tokenises to fewer than 2"):
        model.tokenize(prompts.as_prompts(["w4", "w5"]))


def test_with_bos_no_prompt_is_short(tiny_llama):
    """The word tokenizer with BOS gives every non-empty prompt at least 2 tokens: nothing dropped."""
    batch = tiny_llama.tokenize(prompts.as_prompts(["w4", "w5 w6"]))
    assert batch.lengths == [2, 3] and tiny_llama.prompt_filter["dropped"] == []


@pytest.mark.parametrize("name", ["me_layer", "attention_sinks", "wemask", "sink_causality"])
def test_builtin_prompts_run_on_a_word_tokenizer_without_bos(name, tiny_qwen3):
    """The built-in prompts hold sentences without spaces, one token each under the word tokenizer
    without BOS: they are dropped and the experiment runs (it used to fail with "prompt 24 has a
    single token"); the kept number is recorded."""
    import importlib

    from me_interp.study import execute

    module = importlib.import_module(f"me_interp.experiments.{name}")
    short = [
        i
        for i, p in enumerate(prompts.builtin_prompts())
        if len(tiny_qwen3.tokenizer(p)["input_ids"]) < 2
    ]
    assert short  # the premise: some built-in prompts are one word
    with pytest.warns(UserWarning, match=f"dropped {len(short)} of"):
        outcome = execute(module.EXPERIMENT, module.Config(), tiny_qwen3)
    assert outcome.claims
    assert tiny_qwen3.prompt_filter["n_given"] == len(prompts.builtin_prompts())
    assert tiny_qwen3.prompt_filter["n_kept"] == len(prompts.builtin_prompts()) - len(short)
    assert [d["index"] for d in tiny_qwen3.prompt_filter["dropped"]] == short


# ------------------------------------------------------------------------------------------
# multiple-choice items
# ------------------------------------------------------------------------------------------


def test_mc_items_schema():
    raw = _mc_raw()
    assert len(raw) >= 60
    for d in raw:
        assert set(d) == MC_KEYS
        assert isinstance(d["context"], str) and d["context"] == d["context"].strip()
        assert len(d["choices"]) == 4 and len(set(d["choices"])) == 4
        assert all(c.startswith(" ") and c.strip() for c in d["choices"])
        assert isinstance(d["answer"], int) and 0 <= d["answer"] < 4
    assert len({d["context"] for d in raw}) == len(raw)
    items = evaluation.load_mc_items()
    assert [it.answer for it in items] == [d["answer"] for d in raw]


def test_mc_answer_positions_balanced():
    raw = _mc_raw()
    counts = Counter(d["answer"] for d in raw)
    assert set(counts) == {0, 1, 2, 3}
    assert max(counts.values()) - min(counts.values()) <= 1


# ------------------------------------------------------------------------------------------
# measured with the bundled tokenizer
# ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_builtin_prompts_tokens_on_bundled(bundled):
    st = prompts.prompt_stats(bundled)
    assert (
        bundled.tokenize("x").tokens.shape[1] == 1
    )  # no BOS added: first token is the prompt's own
    assert st.n_first_tokens == st.n >= 72
    assert 16 <= st.min_tokens and st.max_tokens <= 256
    assert st.max_tokens >= 230  # at least one long prompt
    assert 35 <= st.median_tokens <= 55
    assert st.mean_tokens <= 60
    assert 1 <= sum(n > 150 for n in st.lengths) <= 8
    assert sum(st.genres.values()) == st.n
    assert max(st.lengths[:24]) <= 100


@pytest.mark.slow
def test_builtin_texts_tokens_on_bundled(bundled):
    lengths = bundled.tokenize(prompts.builtin_texts()).lengths
    assert 30 <= min(lengths) and max(lengths) <= 120
    assert 30 <= statistics.median(lengths) <= 80


@pytest.mark.slow
def test_mc_choices_tokenize_on_bundled(bundled):
    for it in evaluation.load_mc_items():
        for c in it.choices:
            assert bundled.tokenizer(c, add_special_tokens=False)["input_ids"]
