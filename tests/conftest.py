"""Shared fixtures: where the golden files and the real models are, which golden set holds for the CPU
kernels of the ggml that runs here, and the single-process reference mesh tests compare with."""

from __future__ import annotations

import os
import signal
import tempfile
from pathlib import Path

import pytest

from meshnet.backends.cpu_features import describe, ggml_cpu_features
from meshnet.backends.golden_sets import select_golden_set
from meshnet.model.bundled import ModelNotFound, resolve_model

# reporter_leaks: a test file must close the MeshClients it opens; pytester runs that check's own test.
pytest_plugins = ["reporter_leaks", "pytester"]

# Node keys, the tracker's default ledger and certification results go to a scratch home for the
# run (node subprocesses inherit it), never to the user's own config and data directories.
_SCRATCH = tempfile.mkdtemp(prefix="meshnet-tests-")
for _var in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "MESHNET_CACHE_DIR"):
    os.environ[_var] = os.path.join(_SCRATCH, _var.lower())

# Tests press Ctrl-C on the processes they start (SIGINT). A shell starts a background job with SIGINT
# ignored, and an ignored signal stays ignored in every process started below it: run that way (`bash
# scripts/test.sh &`), those processes never saw the Ctrl-C. Python's own handler here makes it the
# default again in each process started (exec resets a handled signal, not an ignored one).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# $MESHNET_GOLDEN_DIR points the tests (and meshnet itself) at another golden folder, e.g. one holding
# only another CPU's set, to exercise rule 3 on real numbers.
GOLDEN_DIR = Path(os.environ.get("MESHNET_GOLDEN_DIR") or Path(__file__).resolve().parents[2] / "shared" / "golden")
TINY_MODELS = sorted(p.stem for p in (GOLDEN_DIR / "models").glob("*.gguf"))
# The goldens made with the SIMD features of the ggml running here, or the closest set, to be checked
# by the golden README's rule 3 (GOLDEN_SET.exact is False); None without ../shared/golden.
GOLDEN_SET = select_golden_set(GOLDEN_DIR, ggml_cpu_features()) if GOLDEN_DIR.is_dir() else None


def golden_exact() -> bool:
    """True when the goldens were made with exactly this ggml's CPU features (every id holds)."""
    return GOLDEN_SET is not None and GOLDEN_SET.exact


def load_golden(name: str) -> dict:
    """A golden JSON by model name from :data:`GOLDEN_SET`; skips the calling test when
    ../shared/golden (or that model's golden) is absent."""
    if GOLDEN_SET is None:
        pytest.skip(f"golden files not found at {GOLDEN_DIR}")
    golden = GOLDEN_SET.load(name)
    if golden is None:
        pytest.skip(f"golden file {GOLDEN_SET.path(name)} not found")
    return golden


def _golden_line() -> str:
    rule = GOLDEN_SET.rule if GOLDEN_SET is not None else f"none: {GOLDEN_DIR} not found, golden tests skip"
    return f"ggml CPU kernels: {describe(ggml_cpu_features())}; llama.cpp goldens: {rule}"


def pytest_report_header(config):
    return _golden_line()


def pytest_terminal_summary(terminalreporter):
    # Also under -q (which hides the header): a red run on a new machine says which goldens it used.
    terminalreporter.write_line(_golden_line())


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    if not GOLDEN_DIR.is_dir():
        pytest.skip(f"golden files not found at {GOLDEN_DIR}")
    return GOLDEN_DIR


def moe_model_path(name: str) -> Path:
    """A tiny MoE golden model by name (../shared/golden/models-moe); skips the calling test without it."""
    path = GOLDEN_DIR / "models-moe" / f"{name}.gguf"
    if not path.is_file():
        pytest.skip(f"{path} not found")
    return path


@pytest.fixture(scope="session")
def qwen3moe_path() -> Path:
    """The tiny qwen3moe golden model; skips the test without it."""
    return moe_model_path("tiny-qwen3moe")


@pytest.fixture(scope="session")
def deepseek2_path() -> Path:
    """The tiny deepseek2 golden model (MLA, grouped sigmoid routing); skips the test without it."""
    return moe_model_path("tiny-deepseek2")


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


@pytest.fixture(scope="session")
def solo(smollm2_path):
    """Greedy ids of the bundled model in one process on this machine (see solo_reference), computed
    once per test session: what every split, failover and concurrency test must reproduce."""
    from meshnet.tokenizer import GGUFTokenizer
    from solo_reference import SoloReference

    return SoloReference(smollm2_path, GGUFTokenizer.from_gguf(str(smollm2_path)))


@pytest.fixture
def mesh():
    """A tracker in this process, for node subprocesses the test starts (see mesh_util.Mesh)."""
    from mesh_util import Mesh

    m = Mesh()
    yield m
    m.close()


# The join token the token_tracker fixture's tracker asks of every caller.
TRACKER_TOKEN = "correct horse battery staple"


@pytest.fixture
def token_tracker():
    """A tracker in this process that refuses callers without :data:`TRACKER_TOKEN`; its ``HOST:PORT``."""
    from meshnet.tracker.server import serve_tracker

    server, port = serve_tracker(join_token=TRACKER_TOKEN)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None)
