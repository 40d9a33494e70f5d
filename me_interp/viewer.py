"""Attention patterns in CircuitsVis, offline, with the massive token marked.

For one prompt, :func:`attention_view` captures the attention patterns ``A[head, q, k]`` of chosen
layers and heads (``blocks.L.attn.hook_pattern``, one forward, optional intervention hooks) and shows
them with CircuitsVis' ``AttentionHeads`` element (the TransformerLens companion: a thumbnail per head,
the selected head in full, hover for values). :func:`compare_view` shows the same heads side by side
for an unmodified run and a run with any ``fwd_hooks`` (WeMask, a causal edit).

Token labels are the token texts (CircuitsVis adds the position); the massive token(s) carry a
:data:`MARK` prefix. The massive
positions are *detected* on the prompt (:func:`massive_positions`: the tokens massive at the ME layer,
:func:`me_interp.probes.site.locate`), never assumed; none are marked on a model without a massive
activation. Each panel states the attention mass on the marked tokens per head,
``mean_{q>p} A[q, p]`` summed over the marked positions ``p`` (as :func:`probes.attention_stats`).

Offline: the PyPI package ``circuitsvis`` ships its JavaScript bundle (``circuitsvis/dist/cdn/
iife.js``, about 1.3 MB). An :class:`AttentionView` inlines it *once* into one module script that
renders every panel, so a saved page (:meth:`AttentionView.save_html`) opens without a network and
without a CDN (CircuitsVis' own ``_repr_html_`` switches to a CDN whenever it finds the internet).
In Jupyter the view displays itself (``_repr_html_``); :meth:`AttentionView.iframe` wraps it for an
``ipywidgets.HTML`` value (which does not run scripts itself).

Needs the optional extra: ``pip install 'me_interp[notebook]'`` (circuitsvis, ipywidgets);
circuitsvis is imported only when a view is rendered.
"""

from __future__ import annotations

import html
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Float

from me_interp import io, names
from me_interp.loading.loaded import LoadedModel
from me_interp.probes.activations import Activations
from me_interp.probes.batching import record

MARK = "★"
"""Prefix of the massive token's label."""
EXTRA = "pip install 'me_interp[notebook]'"
ELEMENT = "AttentionHeads"
"""The CircuitsVis React element every panel uses."""
DECIMALS = 4
"""Attention probabilities are rounded to this many decimals in the page (its size)."""


def _circuitsvis_bundle() -> str:
    """The JavaScript bundle shipped in the circuitsvis package, ready to inline in a script."""
    try:
        import circuitsvis
    except ImportError as e:
        raise ImportError(f"the attention viewer needs circuitsvis: {EXTRA}") from e
    path = Path(circuitsvis.__file__).parent / "dist" / "cdn" / "iife.js"
    if not path.is_file():
        raise FileNotFoundError(
            f"circuitsvis {getattr(circuitsvis, '__version__', '?')} has no JavaScript bundle at "
            f"{path}; reinstall it ({EXTRA})"
        )
    # a closing script tag inside inline code would end the script (as circuitsvis does)
    return path.read_text(encoding="utf-8").replace("</script>", "")


def _js_json(obj: Any) -> str:
    """JSON that is safe inside a ``<script>``: no ``</`` sequence can close it."""
    return json.dumps(obj, ensure_ascii=False).replace("</", "<\\/")


# ------------------------------------------------------------------------------------------
# data
# ------------------------------------------------------------------------------------------


def _one_prompt(model: LoadedModel, prompt: str):
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
    batch = model.tokenize([prompt])
    if batch.tokens.shape[1] < 2:
        raise ValueError(f"prompt {prompt!r} has a single token: attention needs at least 2")
    return batch


def massive_positions(model: LoadedModel, prompt: str, fwd_hooks: Sequence = ()) -> list[int]:
    """Positions of ``prompt`` that carry a massive activation at the ME layer (the Site located
    on this prompt, under ``fwd_hooks``: :func:`me_interp.probes.site.locate`); ``[]`` when the
    model shows none."""
    from me_interp.probes.norms import scan_norms
    from me_interp.probes.site import SCAN_SITES, locate

    batch = _one_prompt(model, prompt)
    scan = scan_norms(model, batch, SCAN_SITES, extra_hooks=list(fwd_hooks))
    site = locate(model, batch, scan=scan)
    return [] if not site.detected else list(site.positions[0])


def token_labels(model: LoadedModel, prompt: str, marked: Sequence[int] = ()) -> list[str]:
    """The text of each token of ``prompt``, :data:`MARK` before the ``marked`` ones.

    Raises:
        ValueError: a marked position outside the prompt.
    """
    ids = _one_prompt(model, prompt).tokens[0].tolist()
    bad = [p for p in marked if not 0 <= p < len(ids)]
    if bad:
        raise ValueError(f"marked positions {bad} are outside the prompt's {len(ids)} tokens")
    out = []
    for i, t in enumerate(ids):
        text = model.tokenizer.decode([t])
        out.append(f"{MARK if i in marked else ''}{text}")
    return out


def _check_heads(model: LoadedModel, heads: Sequence[int] | None) -> list[int]:
    if heads is None:
        return list(range(model.n_heads))
    heads = list(heads)
    if not heads:
        raise ValueError("heads is empty: give at least one head (or None for all)")
    return [model.check_head(h) for h in heads]


def _check_layers(model: LoadedModel, layers: Sequence[int] | int) -> list[int]:
    layers = [layers] if isinstance(layers, int) else list(layers)
    if not layers:
        raise ValueError("layers is empty: give at least one layer")
    return [model.check_layer(layer) for layer in layers]


def attention_patterns(
    model: LoadedModel, prompt: str, layers: Sequence[int] | int, fwd_hooks: Sequence = ()
) -> dict[int, Float[torch.Tensor, "head query_pos key_pos"]]:
    """The attention probabilities of ``prompt`` at each of ``layers`` (one forward with
    ``fwd_hooks`` added), on the CPU in float32."""
    layers = _check_layers(model, layers)
    batch = _one_prompt(model, prompt)
    acts = Activations(model, batch, [names.pattern(layer) for layer in layers])
    record(model, batch, [acts], fwd_hooks=fwd_hooks, last_layer=max(layers), max_tokens=None)
    return {layer: acts[names.pattern(layer)][0].float().cpu() for layer in layers}  # [head q k]


def mass_on(
    pattern: Float[torch.Tensor, "head query_pos key_pos"], positions: Sequence[int]
) -> list[float]:
    """Per head: ``Σ_{p∈positions} mean_{q>p} A[q, p]`` (the queries that can see ``p``); NaN per head
    when ``positions`` is empty."""
    T = pattern.shape[-1]
    total = torch.zeros(pattern.shape[0])
    if not positions:
        return [float("nan")] * pattern.shape[0]
    for p in positions:
        if not 0 <= p < T - 1:
            raise ValueError(f"position {p} has no later query among {T} tokens")
        total += pattern[:, p + 1 :, p].mean(-1)
    return total.tolist()


# ------------------------------------------------------------------------------------------
# views
# ------------------------------------------------------------------------------------------


@dataclass
class Panel:
    """One run's heads in one CircuitsVis element."""

    title: str
    tokens: list[str]
    attention: Float[torch.Tensor, "n query_pos key_pos"]
    head_names: list[str]
    mass: list[float]
    """Attention mass on the marked tokens, per shown head (NaN without marked tokens)."""

    def props(self) -> dict[str, Any]:
        """The ``AttentionHeads`` props (the names circuitsvis.attention.attention_heads uses)."""
        return {
            "attention": torch.round(self.attention, decimals=DECIMALS).tolist(),
            "tokens": self.tokens,
            "attentionHeadNames": self.head_names,
            "maxValue": 1.0,
            "minValue": 0.0,
            "maskUpperTri": True,
        }

    def note(self) -> str:
        if all(m != m for m in self.mass):  # all NaN
            return "no massive token detected: nothing marked"
        vals = ", ".join(f"{n} {m:.2f}" for n, m in zip(self.head_names, self.mass))
        return f"attention on {MARK} (mean over later queries): {vals}"


@dataclass
class AttentionView:
    """Panels shown side by side; one inlined CircuitsVis bundle renders them all."""

    title: str
    panels: list[Panel]
    marked: list[int] = field(default_factory=list)

    def fragment(self) -> str:
        """An HTML fragment (for a notebook or a page): the panels and one module script."""
        bundle = _circuitsvis_bundle()
        ids = [f"me-interp-cv-{uuid.uuid4().hex[:12]}" for _ in self.panels]
        cols = "".join(
            f"<div class='me-interp-panel' style='flex:1 1 0;min-width:320px'>"
            f"<h4 style='margin:4px 0'>{html.escape(p.title)}</h4>"
            f"<div style='font-size:12px;color:#57606a'>{html.escape(p.note())}</div>"
            f"<div id='{i}' class='me-interp-cv' style='margin:10px 0'></div></div>"
            for i, p in zip(ids, self.panels)
        )
        calls = "\n".join(
            f"CircuitsVis.render({_js_json(i)}, CircuitsVis.{ELEMENT}, {_js_json(p.props())});"
            for i, p in zip(ids, self.panels)
        )
        marked = ", ".join(map(str, self.marked)) or "none detected"
        return (
            f"<div class='me-interp-view'><h3 style='margin:4px 0'>{html.escape(self.title)}</h3>"
            f"<div style='font-size:12px'>{MARK} marks the massive token(s): positions "
            f"{html.escape(marked)}. Rows: queries; columns: keys.</div>"
            f"<div style='display:flex;gap:16px;flex-wrap:wrap'>{cols}</div>"
            f'<script type="module">\n{bundle}\n{calls}\n</script></div>'
        )

    def _repr_html_(self) -> str:
        return self.fragment()

    def to_html(self) -> str:
        """A complete HTML document that renders offline."""
        return (
            "<!doctype html>\n<html><head><meta charset='utf-8'>"
            f"<title>{html.escape(self.title)}</title></head>"
            "<body style='font-family:system-ui,sans-serif;margin:1.5em'>"
            f"{self.fragment()}</body></html>\n"
        )

    def iframe(self, height: int = 900) -> str:
        """The view as an ``<iframe srcdoc>``: for containers that insert HTML without running its
        scripts (e.g. an ``ipywidgets.HTML`` value); the iframe runs them in its own document."""
        if isinstance(height, bool) or not isinstance(height, int) or height < 1:
            raise ValueError(f"height must be a positive int (pixels), got {height!r}")
        return (
            f'<iframe srcdoc="{html.escape(self.to_html(), quote=True)}" '
            f"style='width:100%;height:{height}px;border:0'></iframe>"
        )

    def save_html(self, path: str | Path) -> Path:
        """Write :meth:`to_html` to ``path`` (atomically); returns the path."""
        return io.atomic_write_text(path, self.to_html())


def _panel(
    model: LoadedModel,
    prompt: str,
    layers: list[int],
    heads: list[int],
    fwd_hooks: Sequence,
    title: str,
    marked: list[int],
    labels: list[str],
) -> Panel:
    patterns = attention_patterns(model, prompt, layers, fwd_hooks)
    attention = torch.cat([patterns[layer][heads] for layer in layers])  # [layers*heads q k]
    head_names = [f"L{layer} H{h}" for layer in layers for h in heads]
    mass = (
        [m for layer in layers for m in mass_on(patterns[layer][heads], marked)]
        if marked
        else [float("nan")] * len(head_names)
    )
    return Panel(title, labels, attention, head_names, mass)


def attention_view(
    model: LoadedModel,
    prompt: str,
    layers: Sequence[int] | int,
    heads: Sequence[int] | None = None,
    *,
    fwd_hooks: Sequence = (),
    label: str = "unmodified",
    massive: Sequence[int] | None = None,
) -> AttentionView:
    """The attention patterns of ``prompt`` at ``layers`` × ``heads`` (0-based; ``None``: all heads).

    Args:
        fwd_hooks: interventions for the run shown.
        label: the panel's title.
        massive: positions to mark; ``None``: detected on the unmodified prompt
            (:func:`massive_positions`).
    """
    return compare_view(model, prompt, layers, heads, runs={label: fwd_hooks}, massive=massive)


def compare_view(
    model: LoadedModel,
    prompt: str,
    layers: Sequence[int] | int,
    heads: Sequence[int] | None = None,
    *,
    runs: dict[str, Sequence] | None = None,
    fwd_hooks: Sequence | None = None,
    label: str = "edited",
    massive: Sequence[int] | None = None,
) -> AttentionView:
    """The same heads side by side for several runs of ``prompt``.

    Either ``runs`` (``{title: fwd_hooks}``, in order) or ``fwd_hooks`` (then the panels are
    ``"unmodified"`` and ``label``, e.g. a WeMask run). The marked tokens are the massive tokens of the
    unmodified prompt (``massive`` overrides), so every panel marks the same positions.
    """
    if (runs is None) == (fwd_hooks is None):
        raise ValueError(
            "give either runs={title: fwd_hooks} or fwd_hooks (compared to unmodified)"
        )
    if runs is None:
        runs = {"unmodified": (), label: fwd_hooks}
    if not runs:
        raise ValueError("runs is empty: give at least one run")
    layers_ = _check_layers(model, layers)
    heads_ = _check_heads(model, heads)
    marked = massive_positions(model, prompt) if massive is None else sorted(set(massive))
    labels = token_labels(model, prompt, marked)
    # a mass needs a later query: the last token cannot be marked for the statistic
    usable = [p for p in marked if p < len(labels) - 1]
    panels = [
        _panel(model, prompt, layers_, heads_, list(hooks), title, usable, labels)
        for title, hooks in runs.items()
    ]
    where = ", ".join(f"L{layer}" for layer in layers_)
    return AttentionView(f"Attention patterns at {where}: {prompt[:60]!r}", panels, marked)
