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
# # Attention sinks and the ME layer
#
# This notebook loads the bundled model (SmolLM2-135M-Instruct), finds the layer where the massive
# activation is born (the *ME layer*), looks at attention patterns and sink heads before and after it,
# and applies WeMask (zeroing some dims of the massive token's attention input) to watch the sink and
# the attention entropy change.
#
# The source of this notebook is `experiments/notebooks/attention_sinks.py` (jupytext percent format);
# the `.ipynb` is generated from it with `jupytext --to ipynb`. Layers are **0-based**.

# %%
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from me_interp import load_model, names
from me_interp.interventions.wemask import we_mask
from me_interp.probes import attention_stats, find_me_layer

torch.set_num_threads(1)
model = load_model()  # the bundled model, fp32 on CPU, the tokenizer's own BOS behaviour (none)
model

# %% [markdown]
# ## 1. Where is the massive activation born?

# %%
prompts = [
    "The capital of France is Paris, and the capital of Italy is Rome.",
    "Once upon a time, a small fox lived at the edge of a quiet forest.",
    "def add(a, b):\n    return a + b",
    "Water boils at 100 degrees Celsius at sea level.",
]
batch = model.tokenize(prompts)
loc = find_me_layer(model, batch)
ME = loc.me_layer
print(f"ME layer: {ME} (0-based) = {ME + 1} (1-based); created by the {loc.me_event.site}")
print(f"massive dims: {loc.massive_dims}; positions per prompt: {loc.massive_positions}")
print("norm ratio (massive token / mean of others) per layer:")
print([round(r, 1) for r in loc.site_ratios["resid_post"]])

# %% [markdown]
# ## 2. Attention to the massive token, per layer and head
#
# `attention_stats` gives, for each layer and head, the attention mass that queries 1..T-1 put on
# position 0 (the massive token) and the attention entropy. A *sink head* puts more than 0.3 of its
# attention there (Gu et al.).

# %%
stats = attention_stats(model, batch)
to_sink = stats.to_positions.mean(1)  # [layer, head], mean over prompts
fig = go.Figure(
    go.Heatmap(
        z=to_sink.T.tolist(), colorscale="Viridis", zmin=0, zmax=1, colorbar_title="attention"
    )
)
fig.add_vline(x=ME, line_dash="dash", line_color="red")
fig.update_layout(
    title="Mean attention to the massive token (position 0); dashed: ME layer",
    xaxis_title="layer (0-based)",
    yaxis_title="head",
)
fig

# %%
sink_rate = (to_sink > 0.3).float().mean(-1)
print("share of sink heads (attention to token 0 > 0.3) per layer:")
print([round(x, 2) for x in sink_rate.tolist()])
print(
    f"before the ME layer: {sink_rate[:ME].mean():.2f}; after it: {sink_rate[ME + 1 :].mean():.2f}"
)

# %% [markdown]
# ## 3. Attention patterns just before and just after the ME layer
#
# The head with the strongest sink after the ME layer, at the layer before the ME layer and two
# layers after it, for the first prompt.

# %%
layer_after = min(ME + 2, model.n_layers - 1)
head = int(to_sink[layer_after].argmax())
patterns = {}


def keep(pattern, hook, layer):
    patterns[layer] = pattern[0, head].detach().clone()
    return pattern


from functools import partial

show = [max(ME - 1, 0), layer_after]
model.run_with_hooks(
    model.tokenize(prompts[:1]),
    [(names.pattern(layer), partial(keep, layer=layer)) for layer in show],
)
labels = [model.tokenizer.decode([t]) for t in model.tokenize(prompts[:1]).tokens[0]]
fig = make_subplots(
    rows=1, cols=2, subplot_titles=[f"layer {layer}, head {head}" for layer in show]
)
for i, layer in enumerate(show):
    fig.add_trace(
        go.Heatmap(z=patterns[layer].tolist(), x=labels, y=labels, coloraxis="coloraxis"), 1, i + 1
    )
fig.update_yaxes(autorange="reversed")
fig.update_layout(
    coloraxis={"colorscale": "Viridis"}, title="Attention pattern (query rows, key columns)"
)
fig

# %% [markdown]
# ## 4. WeMask: zero dims of the massive token's attention input
#
# Change `rate` and `variant` and re-run the next cells. `weight` masks the dims with the largest
# pre-attention RMSNorm gain (the paper's text); `activation` the dims with the largest normalised
# activation of the massive token (the authors' released code); `random` and `magnitude` are the
# paper's ablations.

# %%
rate = 0.3
variant = "weight"
hooks = we_mask(model, rate, variant, me_layer=ME)
masked = attention_stats(model, batch, fwd_hooks=hooks)

fig = make_subplots(
    rows=1, cols=2, subplot_titles=["attention to the massive token", "attention entropy (nats)"]
)
for label, s, color in (
    ("unmodified", stats, "steelblue"),
    (f"WeMask {variant} r={rate}", masked, "firebrick"),
):
    fig.add_trace(go.Scatter(y=s.mean_to_positions(), name=label, line_color=color), 1, 1)
    fig.add_trace(
        go.Scatter(y=s.mean_entropy(), name=label, line_color=color, showlegend=False), 1, 2
    )
for c in (1, 2):
    fig.add_vline(x=ME, line_dash="dash", line_color="gray", row=1, col=c)
    fig.update_xaxes(title_text="layer (0-based)", row=1, col=c)
fig.update_layout(title="Sink and entropy with and without WeMask (mean over prompts and heads)")
fig

# %%
before = torch.tensor(stats.mean_to_positions()[ME:]).mean()
after = torch.tensor(masked.mean_to_positions()[ME:]).mean()
print(f"mean attention to the massive token over layers >= {ME}: {before:.3f} -> {after:.3f}")
print(
    "mean entropy over the same layers:",
    f"{torch.tensor(stats.mean_entropy()[ME:]).mean():.3f} -> {torch.tensor(masked.mean_entropy()[ME:]).mean():.3f}",
)

# %% [markdown]
# ## 5. Sweep the mask rate
#
# How the sink responds to the mask rate for each dim selection.

# %%
rates = [0.0, 0.1, 0.3, 0.5, 1.0]
fig = go.Figure()
for v in ("weight", "activation", "random", "magnitude"):
    ys = []
    for r in rates:
        s = attention_stats(model, batch, fwd_hooks=we_mask(model, r, v, me_layer=ME))
        ys.append(float(torch.tensor(s.mean_to_positions()[ME:]).mean()))
    fig.add_trace(go.Scatter(x=rates, y=ys, mode="lines+markers", name=v))
fig.update_layout(
    title=f"Attention to the massive token (layers >= {ME}) vs WeMask rate",
    xaxis_title="mask rate r",
    yaxis_title="mean attention to position 0",
)
fig
