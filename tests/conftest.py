"""Shared fixtures: where the golden files and the real models are."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

from meshnet.model.bundled import ModelNotFound, resolve_model

# Node keys, the tracker's default ledger and certification results go to a scratch home for the
# run (node subprocesses inherit it), never to the user's own config and data directories.
_SCRATCH = tempfile.mkdtemp(prefix="meshnet-tests-")
for _var in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "MESHNET_CACHE_DIR"):
    os.environ[_var] = os.path.join(_SCRATCH, _var.lower())

GOLDEN_DIR = Path(__file__).resolve().parents[2] / "shared" / "golden"
TINY_MODELS = sorted(p.stem for p in (GOLDEN_DIR / "models").glob("*.gguf"))


def load_golden(name: str) -> dict:
    """A golden JSON by model name; skips the calling test when ../shared/golden is absent."""
    path = GOLDEN_DIR / f"{name}.json"
    if not path.is_file():
        pytest.skip(f"golden file {path} not found")
    return json.loads(path.read_text())


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    if not GOLDEN_DIR.is_dir():
        pytest.skip(f"golden files not found at {GOLDEN_DIR}")
    return GOLDEN_DIR


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    try:
        return resolve_model("smollm2")
    except ModelNotFound as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    try:
        return resolve_model("gemma3-270m")
    except ModelNotFound as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def tok(smollm2_path):
    """The bundled model's tokenizer."""
    from meshnet.tokenizer import GGUFTokenizer

    return GGUFTokenizer.from_gguf(str(smollm2_path))


@pytest.fixture
def mesh():
    """A tracker in this process, for node subprocesses the test starts (see mesh_util.Mesh)."""
    from mesh_util import Mesh

    m = Mesh()
    yield m
    m.close()
