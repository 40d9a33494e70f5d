# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # me_interp from a notebook: find, measure, mask, patch, read back
#
# Everything here is `import me_interp` and plain strings: every function that runs the model takes
# a prompt, a list of prompts or a `Batch` (`model.tokenize`). Layers are 0-based. The model is the
# bundled SmolLM2-135M-Instruct (the environment variable `ME_INTERP_NOTEBOOK_MODEL` names another,
# e.g. `synthetic:planted` for the quick CI run); the whole notebook runs in well under a minute on
# a CPU. Its source is `quickstart.py` (jupytext percent format).

# %%
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import tempfile
from pathlib import Path

import torch

import me_interp

torch.set_num_threads(1)
model = me_interp.load_model(os.environ.get("ME_INTERP_NOTEBOOK_MODEL"))  # None: the bundled one
model

# %% [markdown]
# ## Find the ME layer: where the massive activation is born

# %%
loc = me_interp.find_me_layer(model, "The capital of France is Paris.")
print(f"ME layer: {loc.me_layer} (0-based)")
loc

# %% [markdown]
# The Site is what every experiment studies: the layer, each prompt's massive token, the massive
# dims, and the distinct massive-token prefixes behind the effective n.

# %%
prompts = ["The capital of France is Paris.", "def f(x):\n    return x + 1", "Once upon a time"]
site = me_interp.locate(model, prompts)
site

# %% [markdown]
# ## Measure: the attention sink it drives

# %%
stats = me_interp.attention_stats(model, prompts)  # to_positions, entropy: [layer, prompt, head]
sink = stats.mean_to_positions()
print(f"attention to position 0, mean over prompts and heads, after the ME layer {site.layer}:")
print(", ".join(f"L{i} {v:.2f}" for i, v in enumerate(sink) if i > site.layer))

# %% [markdown]
# ## WeMask on a string
#
# Zero 10 % of the dims (the top-|gain| dims of the attention norm, the paper's text) of the massive
# token's attention input in every layer from the ME layer on, and measure what that changes.

# %%
effect = me_interp.we_mask_effect(
    model, "The Eiffel Tower was built for the 1889 World's Fair in Paris.", rate=0.1
)
effect

# %% [markdown]
# ## Patch two string pairs, scored by the logit difference
#
# Clean and corrupt prompts swap the indirect object; `logit_diff` is
# `logit(answer) − logit(wrong)` at each pair's last token. Normalised: clean = 1, corrupt = 0.

# %%
pairs = me_interp.tokenize_pairs(
    model,
    [
        me_interp.Pair(
            "When Mary and John went to the store, John gave a drink to",
            "When Mary and John went to the store, Mary gave a drink to",
            answer=" Mary",
            wrong=" John",
        ),
        me_interp.Pair(
            "When Tom and Anna went to the park, Anna gave a book to",
            "When Tom and Anna went to the park, Tom gave a book to",
            answer=" Tom",
            wrong=" Anna",
        ),
    ],
)
sweep = me_interp.patch_sweep(
    model,
    pairs.clean,
    pairs.corrupt,
    "resid_pre",
    {"logit_diff": me_interp.logit_metric("logit_diff", pairs)},
    layers=list(range(0, model.n_layers, 8)),
    progress=False,
)
clean, corrupt = sweep.clean["logit_diff"], sweep.corrupt["logit_diff"]
print(f"logit_diff clean {clean.tolist()}, corrupt {corrupt.tolist()}")
restored = sweep.normalized("logit_diff")  # [layer pos]: (patched − corrupt) / (clean − corrupt)
best = divmod(int(restored.argmax()), restored.shape[1])
print(
    f"patching resid_pre at layer {sweep.layers[best[0]]}, position {best[1]} restores "
    f"{float(restored.max()):.2f} of the clean logit difference"
)

# %% [markdown]
# ## Read a finished run back as its typed Result
#
# Every experiment writes `<out>/<experiment>/<run_id>/` (`config.json`, `env.json`,
# `result.json`, figures); `me_interp.load_run` gives back the experiment's `Result` object.

# %%
from me_interp.experiments import me_layer
from me_interp.study import execute, write_outcome

out = Path(tempfile.mkdtemp())
(out / "prompts.txt").write_text("\n".join(p.replace("\n", "\\n") for p in prompts))
cfg = me_layer.Config(prompts=str(out / "prompts.txt"), out=str(out))
run_dir = write_outcome("me_layer", cfg, model, execute(me_layer.EXPERIMENT, cfg, model))
result = me_interp.load_run(run_dir)
print(f"{type(result).__module__}.{type(result).__name__}: ME layer {result.me_layer}")
