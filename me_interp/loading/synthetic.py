"""The ``synthetic:`` source: the tiny and planted-mechanism models of :mod:`me_interp.synthetic`
(tests, demos), built from configs on load. :mod:`me_interp.loading` registers it
(:func:`me_interp.loading.sources.register_source`); nothing else in loading knows these models.

Their prompts are words ``w0 … w59``; ``"synthetic:planted-nobos"`` and the decoys
``"synthetic:decoy-<kind>"`` have no BOS (prompts: ``synthetic.distinct_first_prompts``);
``"synthetic:planted-deep"``, ``"synthetic:twin-deep"`` and ``"synthetic:planted-deep-late"`` are
8-layer planted models with BOS (``synthetic.DEEP``); the deep decoys ``"synthetic:decoy-<kind>-deep"``
are 8-layer decoys without BOS, made at layer 6 (``synthetic.DEEP_DECOYS``).
"""

from __future__ import annotations

from me_interp.loading.errors import ModelLoadError

SYNTHETIC_PREFIX = "synthetic:"
SYNTHETIC_MODELS = (
    "planted",
    "twin",
    "tiny-llama",
    "tiny-qwen3",
    "planted-nobos",
    "twin-nobos",
    "planted-deep",
    "twin-deep",
    "planted-deep-late",
    "planted-needsink",
    "planted-needsink-wide",
    "planted-needsink-mild",
    "superweight-spread",
    "superweight-spread-mild",
    "planted-sinkresid",
    "planted-washout",
)
"""The historical names, the no-BOS planted model and twin, the deep planted models (8 layers,
:data:`me_interp.synthetic.DEEP`: enough partner layers for a k-of-n claim to be decided), the
planted models whose language model needs its sink (:data:`me_interp.synthetic.NEEDSINK`); every
architecture ``a`` of
:data:`me_interp.synthetic.ARCHS` also has ``planted-a``, ``twin-a`` and ``tiny-a`` (e.g.
``synthetic:planted-gemma3``), and every kind ``k`` of :data:`me_interp.synthetic.DECOYS`
``decoy-k`` (e.g. ``synthetic:decoy-attention``)."""


def build(spec: str):
    """``synthetic:planted`` / ``twin`` / ``tiny-llama`` / ``tiny-qwen3``, ``planted-nobos`` /
    ``twin-nobos`` (:func:`me_interp.synthetic.planted_nobos`), ``planted-deep`` / ``twin-deep`` /
    ``planted-deep-late`` (:func:`me_interp.synthetic.planted_deep`), ``planted-needsink`` /
    ``planted-needsink-wide`` / ``planted-needsink-mild``
    (:func:`me_interp.synthetic.planted_needsink`), ``superweight-spread`` /
    ``superweight-spread-mild`` (:func:`me_interp.synthetic.superweight_spread`),
    ``planted-washout`` (:func:`me_interp.synthetic.planted_washout`), ``decoy-<kind>``
    (:func:`me_interp.synthetic.decoy`; its ``-deep`` kinds go to
    :func:`me_interp.synthetic.decoy_deep`), and ``planted-<arch>`` / ``twin-<arch>`` /
    ``tiny-<arch>`` for every architecture of :data:`me_interp.synthetic.ARCHS`: ``(hf, tokenizer)``.

    Raises:
        ModelLoadError: no synthetic model has that name (the message lists them).
    """
    from me_interp import synthetic

    kind = spec.removeprefix(SYNTHETIC_PREFIX)
    if kind in ("planted-nobos", "twin-nobos"):
        return synthetic.planted_nobos(plant=kind == "planted-nobos")[:2]
    if kind in synthetic.DEEP:
        return synthetic.planted_deep(kind)[:2]
    if kind in synthetic.NEEDSINK:
        return synthetic.planted_needsink(kind)[:2]
    if kind in synthetic.SPREAD:
        return synthetic.superweight_spread(kind)[:2]
    if kind.startswith("decoy-") and kind.removeprefix("decoy-") in synthetic.DECOYS:
        return synthetic.decoy(kind.removeprefix("decoy-"))[:2]
    if kind == synthetic.SINKRESID:
        return synthetic.planted_sinkresid()[:2]
    if kind == synthetic.WASHOUT:
        return synthetic.planted_washout()[:2]
    if kind == "planted":  # with a chat template that opens with <s>
        hf, tok, _ = synthetic.planted_llama()
        return hf, synthetic.with_chat_template(tok)
    if kind == "twin":
        return synthetic.planted_llama(plant=False)[:2]
    if kind == "tiny-llama":
        return synthetic.tiny_llama()
    if kind == "tiny-qwen3":
        return synthetic.tiny_qwen3()
    what, _, arch = kind.partition("-")
    if arch in synthetic.ARCHS:
        if what == "planted":
            return synthetic.planted(arch)[:2]
        if what == "twin":
            return synthetic.planted(arch, plant=False)[:2]
        if what == "tiny":
            return synthetic.tiny(arch)
    names = [
        *SYNTHETIC_MODELS,
        *(f"{w}-<arch>" for w in ("planted", "twin", "tiny")),
        "decoy-<kind>",
    ]
    import difflib

    close = difflib.get_close_matches(spec, [r["name"] for r in catalogue_rows()], n=1, cutoff=0.75)
    raise ModelLoadError(
        f"unknown synthetic model {spec!r}; "
        + (f"did you mean {close[0]}? see `me-interp models`; " if close else "")
        + "choose one of "
        + ", ".join(SYNTHETIC_PREFIX + k for k in names)
        + f" (<arch>: {', '.join(synthetic.ARCHS)}; <kind>: {', '.join(synthetic.DECOYS)})"
    )


def catalogue_rows() -> list[dict[str, str]]:
    """The catalogue rows of the synthetic models: :data:`SYNTHETIC_MODELS`, then per architecture
    and per decoy."""
    from me_interp import synthetic

    what = {
        "planted": "the mechanism planted at a known layer",
        "twin": "the planted model's twin: no massive activation",
        "tiny": "random weights",
    }
    about = synthetic.describe_models()
    about.update(
        {
            f"{w}-{a}": f"{what[w]} ({a})"
            for a in synthetic.ARCHS
            for w in ("planted", "twin", "tiny")
        }
    )
    about.update({f"decoy-{k}": f"decoy: {v}" for k, v in synthetic.DECOYS.items()})
    return [
        {"name": SYNTHETIC_PREFIX + k, "kind": "synthetic", "status": "built on load", "about": v}
        for k, v in {**dict.fromkeys(SYNTHETIC_MODELS, ""), **about}.items()
    ]


__all__ = ["SYNTHETIC_MODELS", "SYNTHETIC_PREFIX", "build", "catalogue_rows"]
