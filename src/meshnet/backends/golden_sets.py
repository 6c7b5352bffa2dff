"""llama.cpp's goldens per CPU feature set, and which set holds exactly for the ggml that runs here.

The golden folder (``shared/golden`` beside the checkout, or ``$MESHNET_GOLDEN_DIR``) keeps one set of
JSON files at its top, made by llama.cpp on an AVX2 machine, and further sets in subfolders
(``avx512/``) with the same file names, each made on another feature set; every JSON records the
features its llama.cpp ran in ``llama_cpp.system_info``. The GGUF files themselves are shared
(``models/``, ``models-moe/``).

Exact greedy ids hold only where the SIMD features of the running ggml equal those of the golden's
llama.cpp (:mod:`meshnet.backends.cpu_features`; build options such as REPACK take no part). With no
such set, a consumer applies the golden README's rule 3 (ids equal up to the first golden near-tie,
divergence only at a near-tie, logits within tolerance) against the closest set.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from meshnet.backends.cpu_features import describe, parse_system_info

# Subfolders of the golden root that hold models, not a golden set.
_NOT_SETS = frozenset({"models", "models-moe"})


def golden_root() -> Path | None:
    """``$MESHNET_GOLDEN_DIR``, else the first ``shared/golden`` above this source file (the project's
    checkout layout), else None."""
    env = os.environ.get("MESHNET_GOLDEN_DIR")
    if env:
        return Path(env) if Path(env).is_dir() else None
    for anc in Path(__file__).resolve().parents:
        cand = anc / "shared" / "golden"
        if cand.is_dir():
            return cand
    return None


def _features_of(path: Path) -> frozenset[str]:
    """The SIMD features of the llama.cpp that wrote golden JSON ``path``.

    Raises:
        ValueError: the file has no ``llama_cpp.system_info``.
    """
    data = json.loads(path.read_text())
    info = (data.get("llama_cpp") or {}).get("system_info")
    if not info:
        raise ValueError(f"{path} records no llama_cpp.system_info")
    return parse_system_info(info)


@dataclass(frozen=True)
class GoldenSet:
    """One folder of goldens made on one CPU feature set, judged against the running ggml.

    Attributes:
        root: the golden root (GGUFs under ``root / "models"``).
        directory: the folder of this set's JSON files.
        name: ``"top"`` for the root's own files, else the subfolder's name (``"avx512"``).
        features: SIMD features of the llama.cpp that made the set.
        running: SIMD features of the ggml running here.
        exact: ``features == running``: the set's greedy ids and logits hold exactly here.
    """

    root: Path
    directory: Path
    name: str
    features: frozenset[str]
    running: frozenset[str]

    @property
    def exact(self) -> bool:
        return self.features == self.running

    @property
    def rule(self) -> str:
        """One line: which set, which rule and why (printed by the test run and ``meshnet backends``)."""
        where = f"goldens '{self.name}' ({self.directory}, made with {describe(self.features)})"
        if self.exact:
            return f"{where}: exact, the running ggml has the same SIMD features"
        return (f"{where}: rule 3 (ids equal up to the first golden near-tie, logits within tolerance): "
                f"no golden set was made with this ggml's features ({describe(self.running)})")

    def path(self, name: str) -> Path:
        """The JSON of model ``name`` in this set (may not exist)."""
        return self.directory / f"{name}.json"

    def load(self, name: str) -> dict | None:
        """Golden ``name`` (file stem, e.g. ``"SmolLM2-135M-Instruct.Q4_1"``), or None if the set has none.

        Raises:
            ValueError: the file was made on other features than the rest of its set.
        """
        path = self.path(name)
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        made = parse_system_info(data["llama_cpp"]["system_info"])
        if made != self.features:
            raise ValueError(f"{path} was made with {describe(made)}, its set with {describe(self.features)}")
        return data


def golden_sets(root: Path, running) -> list[GoldenSet]:
    """Every golden set under ``root`` (the top folder first, then subfolders by name), each with the
    features read from its first JSON file. Folders without golden JSONs are not sets."""
    running = frozenset(running)
    sets = []
    for directory in [root] + sorted(p for p in root.iterdir() if p.is_dir() and p.name not in _NOT_SETS):
        files = sorted(directory.glob("*.json"))
        if not files:
            continue
        try:
            features = _features_of(files[0])
        except (OSError, ValueError, KeyError):
            continue
        sets.append(GoldenSet(root, directory, "top" if directory == root else directory.name, features, running))
    return sets


def select_golden_set(root: Path, running) -> GoldenSet | None:
    """The set made with exactly the ``running`` SIMD features; else the closest one (most features
    shared, then fewest extra; the top folder wins a tie), whose ``exact`` is False. None when
    ``root`` holds no golden set."""
    sets = golden_sets(root, running)
    if not sets:
        return None
    for s in sets:
        if s.exact:
            return s
    running = frozenset(running)
    return max(sets, key=lambda s: (len(s.features & running), -len(s.features - running), s.name == "top"))


def running_golden_set() -> GoldenSet | None:
    """:func:`select_golden_set` for the golden root here and the loaded ggml's features (imports ggml);
    None without a golden root."""
    from meshnet.backends.cpu_features import ggml_cpu_features

    root = golden_root()
    return select_golden_set(root, ggml_cpu_features()) if root is not None else None
