"""GGUF metadata and tensors ggml cannot run with are refused at load, naming the key or tensor.

Each case is the tiny llama (or qwen3moe) golden model rewritten with one key or tensor changed. The rule:
a bad file is refused at load with exit status 2 and a message naming the key or tensor, never a Python
traceback, a ZeroDivisionError, a ggml abort (SIGABRT) or a hang."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from conftest import GOLDEN_DIR
from gguf_rewrite import rewrite_gguf as rewrite

LLAMA = GOLDEN_DIR / "models" / "tiny-llama-q8_0.gguf"
V = gguf.GGUFValueType
Q = gguf.GGMLQuantizationType


def generate(model: Path) -> subprocess.CompletedProcess:
    """``meshnet generate`` in a session of its own; the whole process group is killed afterwards, since a
    ggml abort forks backtrace helpers that otherwise stay behind, blocked on a pipe, after a timeout."""
    proc = subprocess.Popen([sys.executable, "-m", "meshnet.cli", "generate", "--model", str(model), "--temperature",
                             "0", "--max-tokens", "2", "Hello"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=40)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def assert_refused(model: Path, *named: str) -> None:
    try:
        proc = generate(model)
    except subprocess.TimeoutExpired:
        pytest.fail("meshnet generate hung (killed after 40 s) instead of refusing the file")
    tail = "\n".join(proc.stderr.strip().splitlines()[-4:])
    assert proc.returncode == 2, f"exit status {proc.returncode}, expected 2; stderr ends:\n{tail}"
    assert "Traceback" not in proc.stderr, tail
    for word in named:
        assert word in proc.stderr, tail


@pytest.fixture(autouse=True)
def _need_models():
    if not LLAMA.is_file():
        pytest.skip(f"{LLAMA} not found")


def test_head_count_zero_is_refused_naming_the_key(tmp_path):
    """llama.attention.head_count = 0: ModelConfig.from_reader divides by it.

    Symptom (exit 1, traceback): hparams.py from_reader
    ``head_dim = int(opt(gguf.Keys.Attention.KEY_LENGTH, n_embd // n_head))`` ->
    ``ZeroDivisionError: integer division or modulo by zero``."""
    bad = rewrite(LLAMA, tmp_path / "m.gguf", {"llama.attention.head_count": 0})
    assert_refused(bad, "head_count")


def test_key_length_zero_is_refused_naming_the_key(tmp_path):
    """llama.attention.key_length = 0 (head_dim 0): the attention scale divides by sqrt(0).

    Symptom (exit 1, traceback): hparams.py from_reader ``... or 1.0 / math.sqrt(head_dim))`` ->
    ``ZeroDivisionError: float division by zero``."""
    bad = rewrite(LLAMA, tmp_path / "m.gguf", {"llama.attention.key_length": 0},
                  {"llama.attention.key_length": (V.UINT32, None)})
    assert_refused(bad, "key_length")


def test_per_layer_head_count_array_is_refused_naming_the_key(tmp_path):
    """llama.attention.head_count stored as a per-layer array (as some converters write it).

    Symptom (exit 1, traceback): hparams.py from_reader ``n_head = int(req(...HEAD_COUNT))`` ->
    ``TypeError: int() argument must be a string, a bytes-like object or a real number, not 'list'``."""
    bad = rewrite(LLAMA, tmp_path / "m.gguf", {"llama.attention.head_count": [4, 4, 4, 4]},
                  {"llama.attention.head_count": (V.ARRAY, V.UINT32)})
    assert_refused(bad, "head_count")


@pytest.mark.parametrize("n_rot, ggml_assert", [(64, "GGML_ASSERT(n_dims <= ne0)"), (15, "GGML_ASSERT(n_dims % 2 == 0)")])
def test_rope_dimension_count_that_ggml_cannot_rotate_is_refused_at_load(tmp_path, n_rot, ggml_assert):
    """llama.rope.dimension_count larger than the head size (64 > 16) or odd (15) is accepted at load;
    the first step's rope aborts inside ggml.

    Symptom: ``meshnet generate`` prints the start line, then
    ``ggml-cpu/ops.cpp:5883: GGML_ASSERT(n_dims <= ne0) failed`` and dies of SIGABRT (exit -6); with 15,
    ``ops.cpp:5884: GGML_ASSERT(n_dims % 2 == 0) failed`` and the process then hangs (killed by the
    timeout) instead of exiting."""
    bad = rewrite(LLAMA, tmp_path / "m.gguf", {"llama.rope.dimension_count": n_rot})
    assert_refused(bad, "dimension_count")


@pytest.mark.parametrize("eps", [float("nan"), -1e-5])
def test_negative_or_nan_rms_epsilon_is_refused_at_load(tmp_path, eps):
    """llama.attention.layer_norm_rms_epsilon NaN or negative is accepted at load; ggml's rms_norm aborts.

    Symptom: ``ggml-cpu/ops.cpp:3805: GGML_ASSERT(eps >= 0.0f) failed``, SIGABRT (exit -6)."""
    bad = rewrite(LLAMA, tmp_path / "m.gguf", {"llama.attention.layer_norm_rms_epsilon": eps})
    assert_refused(bad, "layer_norm_rms_epsilon")


def _retype_norm(name, data, tt):
    if name == "blk.1.attn_norm.weight":
        return data.astype(np.float16), Q.F16, data.shape
    return data, tt, data.shape


def test_a_norm_weight_of_a_type_the_graph_cannot_multiply_is_refused_naming_it(tmp_path):
    """blk.1.attn_norm.weight stored as F16 (shape right): the manifest checks names and shapes, not
    types, and ggml's CPU mul has no f32 x f16 kernel.

    Symptom: ``ggml-cpu/binary-ops.cpp:135: binary_op: unsupported types: dst: f32, src0: f32, src1: f16``,
    SIGABRT (exit -6) at the first step."""
    bad = rewrite(LLAMA, tmp_path / "m.gguf", tensors=_retype_norm)
    assert_refused(bad, "blk.1.attn_norm.weight")


def _narrow(target):
    def fn(name, data, tt):
        if name == target:  # [n_vocab, 64] -> [n_vocab, 32]: ne0 32 instead of n_embd 64
            d = np.ascontiguousarray(gguf.dequantize(data, tt)[:, :32].astype(np.float32))
            return d, Q.F32, d.shape
        return data, tt, data.shape
    return fn


@pytest.mark.parametrize("target, ggml_assert", [("token_embd.weight", "ggml.c:2224: GGML_ASSERT(ggml_can_repeat(b, a))"),
                                                  ("output.weight", "ggml.c:3243: GGML_ASSERT(ggml_can_mul_mat(a, b))")])
def test_token_embd_or_output_with_the_wrong_embedding_width_is_refused_naming_it(tmp_path, target, ggml_assert):
    """token_embd.weight / output.weight with ne0 32 instead of n_embd 64: the manifest never checks their
    shape (``_GLOBAL``: shape None, 'some files pad the vocabulary', but ne0 is not the vocabulary).

    Symptom: the first step aborts in ggml: ``ggml.c:2224: GGML_ASSERT(ggml_can_repeat(b, a)) failed``
    (token_embd) / ``ggml.c:3243: GGML_ASSERT(ggml_can_mul_mat(a, b)) failed`` (output), SIGABRT (exit -6)."""
    bad = rewrite(LLAMA, tmp_path / "m.gguf", tensors=_narrow(target))
    assert_refused(bad, target)


def test_a_huge_block_count_is_refused_promptly(tmp_path):
    """llama.block_count = 200,000,000 in a 4-block file: check_tensors builds the expected-tensor dict for
    every one of the 2e8 blocks before finding that blk.4 is missing.

    Symptom: ``meshnet generate`` runs for minutes, memory growing (faulthandler after 15 s:
    arch_manifest.py line 213 in check_tensors <- hparams.py from_reader <- local_mesh.py plan_ranges), where
    a file whose block_count exceeds the blocks it holds should be refused at once naming block_count."""
    bad = rewrite(LLAMA, tmp_path / "m.gguf", {"llama.block_count": 200_000_000})
    assert_refused(bad, "block_count")


def test_a_denormal_rope_scaling_factor_is_refused_naming_the_key(tmp_path):
    """deepseek2.rope.scaling.factor = 1e-45 (a float32 denormal): 1/factor overflows to inf and the YaRN
    maths takes log(0).

    Symptom (minor): exit 2 but the whole message is ``error: math domain error`` (after a numpy
    ``RuntimeWarning: divide by zero`` line pointing into hparams.py), naming neither the key nor the file."""
    src = GOLDEN_DIR / "models-moe" / "tiny-deepseek2.gguf"
    bad = rewrite(src, tmp_path / "m.gguf", {"deepseek2.rope.scaling.factor": 1e-45})
    assert_refused(bad, "rope.scaling.factor")


def test_a_vocab_size_below_the_tokenizers_token_count_is_refused_at_load(tmp_path):
    """llama.vocab_size = 10 under a tokenizer of many more tokens: it loaded, then the first step holding a
    token id past 10 failed mid-run (exit 1, INVALID_ARGUMENT ``token id ... outside the vocabulary``)."""
    bad = rewrite(LLAMA, tmp_path / "m.gguf", {"llama.vocab_size": 10}, {"llama.vocab_size": (V.UINT32, None)})
    assert_refused(bad, "vocab_size 10 but its tokenizer lists")
