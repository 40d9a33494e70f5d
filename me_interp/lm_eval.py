"""WeMask inside lm-evaluation-harness: a registered lm-eval model and a command line.

    python -m me_interp.lm_eval --model me_interp \\
        --model_args pretrained=Qwen/Qwen3-4B,rate=0.1,variant=weight,me_layer=6,dtype=bfloat16 \\
        --tasks mmlu,piqa,arc_challenge --device cuda --batch_size 8 --output_path results/

``python -m me_interp.lm_eval`` takes lm-eval's own command line (lm-eval 0.4.13 has no plugin flag):
it registers the model ``me_interp`` (:class:`WeMaskLM`, an ``HFLM`` subclass), adds
``--include_path`` for the local tasks of :mod:`me_interp.tasks` (``me_interp_mc``,
``me_interp_gsm8k``, ``me_interp_aime25``, ``me_interp_humaneval``) to every subcommand (``run``,
``ls tasks``, ``validate``; :func:`cli_args`) and calls lm-eval's CLI. Any
``HFLM`` argument (``pretrained``, ``dtype``, ``device``, ``batch_size``, ``peft``, ...) works; the
WeMask ones are

==================  =============================================================================
``intervention``    ``wemask`` (default), ``dim_projection`` (soft: ``h − α P_S h`` on the WeMask
                    dims), ``direction_projection`` (soft: ``h − α (⟨h,v⟩/‖v‖²) v``, ``v`` the mean
                    attention input of the first token over the built-in prompts, per layer) or
                    ``none`` (the unmasked baseline through the same code)
``variant``         ``weight`` (the paper), ``activation`` (the released code), ``random``,
                    ``magnitude``, ``activation_per_prompt`` (``docs/wemask.md``)
``rate``            ``r ∈ [0, 1]`` (default 0.1)
``alpha``           ``α ∈ [0, 1]`` of the soft alternatives (default 1)
``layers``          ``auto`` (default: ``start`` from the ME layer to the last layer), ``A-B``
                    (inclusive) or ``A|B|C``
``start``           ``ge`` (layers ≥ ME, the paper) or ``gt``
``me_layer``        the ME layer (0-based); default: measured with me_interp's own scan
                    (:func:`me_interp.interventions.wemask.me_layer_index`, the built-in prompts) on a
                    separate copy of the model, loaded once and dropped
``positions``       ``first`` (default: the first real token of every row) or ``A|B``: positions
                    counted from the first real token
``seed``            seed of the ``random`` variant
==================  =============================================================================

**Which token is masked.** The hooks count positions from each row's first real token
(:mod:`~me_interp.interventions.hf_hooks`, ``positions_from="mask"``). Log-likelihood requests are
right-padded and run without an attention mask, so the first real token is index 0; generation
(``generate_until``) is left-padded and goes through ``model.generate`` with the attention mask, so
the first real token is found from the mask, and a KV-cache decode step (one query after the prompt)
never edits a generated token (tested: exactly one edited token per row and masked layer).

**What the results record.** lm-eval writes the ``model_args`` string into ``config.model_args``;
:meth:`WeMaskLM.get_model_info` adds ``config.me_interp`` with the resolved settings: the ME layer
and where it came from, the masked layers, the dims count per layer, the spec, and ``device``, the
device the model ran on.

**Device.** Without ``--device`` the model runs on CUDA when there is one, else on the CPU with a
warning (the command line then passes ``--device cpu`` on, so lm-eval's ``config.device`` says
``cpu`` too; from Python ``config.device`` is whatever was passed to ``simple_evaluate``).
``config.me_interp.device`` is always the device used. A device this machine lacks (``--device
cuda`` without CUDA) is refused with an error, never switched.

**Packaged models.** ``pretrained=bundled`` (the default) and ``pretrained=gemma-3-270m`` (any
short name of :mod:`me_interp.packaged`) evaluate the converted copy in me_interp's cache
(:func:`me_interp.models.local_path`).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence
from typing import Any

from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from me_interp.interventions import wemask as wm
from me_interp.interventions.hf_hooks import HFInterventions

INTERVENTIONS = ("wemask", "dim_projection", "direction_projection", "none")
MODEL_NAME = "me_interp"
#: lm-eval's subcommands (anything else is the implicit ``run``).
SUBCOMMANDS = ("run", "ls", "validate")
NO_CUDA_WARNING = (
    "no device given and this machine has no CUDA device: evaluating on the CPU "
    "(config.me_interp.device in the results is the device used)"
)


def parse_layers(value: Any) -> str | tuple[int, ...]:
    """``"auto"``, an int, ``"A-B"`` (inclusive) or ``"A|B|C"`` → ``"auto"`` or a tuple of ints."""
    if isinstance(value, bool):
        raise ValueError(f"layers must be auto, A-B or A|B|C, got {value!r}")
    if isinstance(value, int):
        return (value,)
    s = str(value).strip()
    if s == "auto":
        return "auto"
    try:
        if "-" in s:
            a, b = (int(x) for x in s.split("-"))
            if b < a:
                raise ValueError
            return tuple(range(a, b + 1))
        return tuple(int(x) for x in s.split("|"))
    except ValueError:
        raise ValueError(f"layers must be auto, A-B (inclusive) or A|B|C, got {value!r}") from None


def parse_positions(value: Any) -> tuple[int, ...]:
    """``"first"`` → ``(0,)``; an int or ``"A|B"`` → positions counted from the first real token."""
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    s = str(value).strip()
    if s == "first":
        return (0,)
    if s == "massive":
        raise ValueError(
            "positions=massive is not available in lm-eval: the massive positions differ per row, "
            "and lm-eval batches arbitrary requests. Use positions=first (the first real token, "
            "the massive token of the models studied) or explicit positions A|B"
        )
    try:
        pos = tuple(int(x) for x in s.split("|"))
    except ValueError:
        raise ValueError(f"positions must be first or A|B (ints), got {value!r}") from None
    if any(p < 0 for p in pos):
        raise ValueError(f"positions are counted from the first real token: >= 0, got {pos}")
    return pos


def _source(pretrained: Any) -> tuple[Any, Any]:
    """What to hand HFLM: the cache directory of the bundled or a packaged model
    (:func:`me_interp.loading.local_path`), a model object and its tokenizer for a registered
    source's models (synthetic ones), else
    ``pretrained`` itself (a directory, an HF name, a model object)."""
    from me_interp import loading
    from me_interp.interventions.hf_hooks import load_hf
    from me_interp.loading.sources import source_for

    if source_for(pretrained) is not None:  # a registered source (synthetic models)
        return load_hf(pretrained)
    return loading.local_path(pretrained) or pretrained, None


def _device(device: Any) -> str:
    """The device to hand HFLM: ``device`` itself when this machine has it; without one, CUDA when
    available, else the CPU with a warning (HFLM's own default, ``cuda``, would fail there).

    Raises:
        me_interp.models.ModelLoadError: ``device`` names a device this machine lacks (``cuda`` on a
            machine without CUDA): no silent switch to the CPU.
    """
    from me_interp import models

    if device is None:
        dev = models.default_device()
        if dev.type == "cpu":
            warnings.warn(NO_CUDA_WARNING, stacklevel=3)
        return str(dev)
    models.resolve_device(device)  # raises for a device this machine does not have
    return str(device)


@register_model(MODEL_NAME, "wemask")
class WeMaskLM(HFLM):
    """lm-eval's ``HFLM`` with a WeMask (or soft) intervention on the model for its whole life.

    Args (besides ``HFLM``'s; see the module docstring): ``intervention``, ``variant``, ``rate``,
    ``alpha``, ``layers``, ``start``, ``me_layer``, ``positions``, ``seed``.

    Raises:
        ValueError: a bad setting (unknown intervention or variant, rate or alpha outside [0, 1],
            malformed layers or positions).
        me_interp.claims.NotApplicable: ``layers=auto`` without ``me_layer`` on a model without a
            massive activation (no ME layer to start from).
    """

    def __init__(
        self,
        pretrained: Any = "bundled",
        intervention: str = "wemask",
        variant: str = "weight",
        rate: float = 0.1,
        alpha: float = 1.0,
        layers: Any = "auto",
        start: str = "ge",
        me_layer: int | None = None,
        positions: Any = "first",
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        from me_interp.interventions import core

        if intervention not in INTERVENTIONS:
            raise ValueError(f"intervention must be one of {INTERVENTIONS}, got {intervention!r}")
        wm.check_variant(variant)
        core.check_fraction(rate, "rate")
        core.check_fraction(alpha, "alpha")
        if start not in wm.STARTS:
            raise ValueError(f"start must be one of {wm.STARTS}, got {start!r}")
        layer_arg = parse_layers(layers)
        pos = parse_positions(positions)
        src, tok = _source(pretrained)
        if tok is not None:
            kwargs.setdefault("tokenizer", tok)
        kwargs["device"] = _device(kwargs.get("device"))
        self._me_layer_given = me_layer is not None
        super().__init__(pretrained=src, **kwargs)
        detector = None
        needs_detector = intervention == "direction_projection" or (
            intervention != "none" and layer_arg == "auto" and me_layer is None
        )
        if needs_detector:
            detector = _detector(pretrained, str(self.device))
            if layer_arg == "auto" and me_layer is None:
                me_layer = wm.me_layer_index(detector)
        self.wemask_settings: dict[str, Any] = {
            "intervention": intervention,
            "variant": variant,
            "rate": float(rate),
            "alpha": float(alpha),
            "start": start,
            "positions": list(pos),
            "positions_rule": "counted from the first real token of each row (attention mask)",
            "seed": int(seed),
            "me_layer": me_layer,
            "me_layer_source": "given" if self._me_layer_given else "measured",
            "device": str(self.device),
        }
        self._handle: HFInterventions | None = None
        if intervention == "none":
            self.wemask_settings["layers"] = []
            return
        hf = self.model
        n = core.n_layers_of(hf)
        if layer_arg == "auto":
            chosen = wm.mask_layers(hf, start, me_layer=me_layer)
        else:
            chosen = core.check_layers(layer_arg, n, "layers")
        spec = _spec(hf, intervention, chosen, variant, rate, alpha, pos, seed, detector)
        del detector
        self.wemask_settings["layers"] = list(chosen)
        self.wemask_settings["spec"] = spec.to_dict() if hasattr(spec, "to_dict") else {}
        if intervention != "direction_projection":
            self.wemask_settings["n_dims"] = wm.n_dims(variant, rate, core.d_model_of(hf))
        self._handle = HFInterventions(hf, [spec], positions_from="mask").register()

    @property
    def hooks(self) -> HFInterventions | None:
        """The registered hooks (``.stats`` counts the edited tokens per layer), or ``None``."""
        return self._handle

    def remove_hooks(self) -> None:
        """Take the intervention off the model (the object then evaluates the unmodified model)."""
        if self._handle is not None:
            self._handle.remove()

    def get_model_info(self) -> dict:
        info = super().get_model_info()
        info[MODEL_NAME] = dict(self.wemask_settings)
        return info


def _detector(pretrained: Any, device: str):
    """A separate me_interp copy of the model for the ME-layer scan (and direction estimate)."""
    from me_interp import load_model

    return load_model(None if pretrained in (None, "bundled") else pretrained, device=device)


def _spec(hf, intervention, layers, variant, rate, alpha, pos, seed, detector):
    from me_interp.interventions.soft import DirectionProjection, estimate_direction

    if intervention == "direction_projection":
        from me_interp.prompts import builtin_prompts

        batch = detector.tokenize(builtin_prompts())
        v = estimate_direction(detector, batch, layers, positions=(0,))
        return DirectionProjection.build(
            hf, alpha, {L: v[L] for L in layers}, layers, positions=pos
        )
    keep = 0.0 if intervention == "wemask" else 1.0 - float(alpha)
    return wm.WeMask.build(hf, layers, rate, variant, pos, seed, keep=keep)


def _option(args: Sequence[str], name: str) -> str | None:
    """The value of ``--name X`` or ``--name=X`` in ``args`` (the last one), or ``None``."""
    value = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def cli_args(args: Sequence[str]) -> list[str]:
    """lm-eval's command line for ``args`` (after ``python -m me_interp.lm_eval``).

    * ``--include_path`` of the local tasks (:data:`me_interp.tasks.TASK_DIR`) is added to every
      subcommand (``run``, the implicit run, ``ls``, ``validate``), unless ``args`` give their own
      (lm-eval takes one path from the command line); not to a bare ``run`` (lm-eval prints its help);
    * for a run without ``--device`` on a machine without CUDA, ``--device cpu`` is added (with a
      warning) so that lm-eval's ``config.device`` records the device used, not its default ``cuda:0``.

    Raises:
        me_interp.models.ModelLoadError: ``--device`` names a device this machine lacks (``cuda``
            without CUDA).
    """
    from me_interp import models
    from me_interp.tasks import TASK_DIR

    out = list(args)
    if out == ["run"]:
        return out
    is_run = not out or out[0] not in SUBCOMMANDS or out[0] == "run"
    if is_run and not {"-h", "--help"} & set(out):
        device = _option(out, "--device")
        if device is None:
            if models.default_device().type == "cpu":
                warnings.warn(NO_CUDA_WARNING, stacklevel=2)
                out += ["--device", "cpu"]
        else:
            models.resolve_device(device)
    if _option(out, "--include_path") is None:
        out += ["--include_path", str(TASK_DIR)]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """lm-eval's CLI with the ``me_interp`` model registered, the local tasks included and the
    device checked (:func:`cli_args`); returns the exit status (2: a device this machine lacks)."""
    from lm_eval.__main__ import cli_evaluate

    from me_interp.loading.errors import ModelLoadError

    args = list(sys.argv[1:] if argv is None else argv)
    if args in ([], ["-h"], ["--help"]):
        print(f"python -m me_interp.lm_eval: lm-eval with WeMask.\n\n{__doc__}\n")
        print("lm-eval's own options follow (python -m me_interp.lm_eval run --help for all):\n")
        args = ["--help"]
    else:
        try:
            args = cli_args(args)
        except ModelLoadError as e:
            print(f"python -m me_interp.lm_eval: error: {e}", file=sys.stderr)
            return 2
    old = sys.argv
    sys.argv = ["lm-eval", *args]
    try:
        cli_evaluate()
    except SystemExit as e:  # argparse --help / errors
        return int(e.code or 0) if isinstance(e.code, int) or e.code is None else 1
    finally:
        sys.argv = old
    return 0


__all__ = ["INTERVENTIONS", "WeMaskLM", "cli_args", "main", "parse_layers", "parse_positions"]


if __name__ == "__main__":
    raise SystemExit(main())
