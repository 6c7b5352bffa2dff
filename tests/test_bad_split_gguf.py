"""Split sets with broken split keys are refused promptly, naming the key or shard.

The set is the tiny llama golden model split by llama.cpp's ``llama-gguf-split --split-max-tensors 15`` (3
shards), or by gguf-py's splitting writer where the tool is not built; the first shard is then rewritten
with one split key changed. The rule: refused at start-up, exit status 2, a short message naming the
key, never a traceback or a hang."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from conftest import GOLDEN_DIR
from gguf_rewrite import rewrite_gguf
from meshnet.bench.llama_server import find_tool
from meshnet.model.gguf_split import SPLIT_COUNT

LLAMA = GOLDEN_DIR / "models" / "tiny-llama-q8_0.gguf"
SPLIT_TOOL = find_tool("llama-gguf-split")
V = gguf.GGUFValueType


@pytest.fixture(scope="module")
def first_shard(tmp_path_factory) -> Path:
    if not LLAMA.is_file():
        pytest.skip(f"{LLAMA} not found")
    out = tmp_path_factory.mktemp("split")
    if SPLIT_TOOL is not None:
        subprocess.run([str(SPLIT_TOOL), "--split", "--split-max-tensors", "15", str(LLAMA), str(out / "ll")],
                       check=True, capture_output=True, timeout=120)
    else:
        rewrite_gguf(LLAMA, out / "ll.gguf", split_max_tensors=15)
    return out / "ll-00001-of-00003.gguf"


def with_key(src: Path, dst: Path, key: str, value, vtype, sub=None) -> Path:
    """``src`` rewritten to ``dst`` with metadata ``key`` set to ``value`` of type ``vtype``."""
    return rewrite_gguf(src, dst, {key: value}, {key: (vtype, sub)})


def generate(model: Path) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, "-m", "meshnet.cli", "generate", "--model", str(model), "--stages", "3",
                               "--temperature", "0", "--max-tokens", "2", "Hello"],
                              capture_output=True, text=True, timeout=40)
    except subprocess.TimeoutExpired:
        pytest.fail("meshnet generate hung (killed after 40 s) instead of refusing the set")


def test_a_split_count_far_beyond_a_u16_is_refused_promptly(first_shard, tmp_path):
    """split.count = 100,000,000 (written as u32; llama.cpp's split.count is a u16), the file named
    ``ll-00001-of-100000000.gguf``.

    Symptom: ``open_split`` builds a tuple of 1e8 shard Paths and stats each before saying anything:
    ``meshnet generate`` is still running (memory growing) when killed after 40 s."""
    bad = with_key(first_shard, tmp_path / "ll-00001-of-100000000.gguf", SPLIT_COUNT, 10**8, V.UINT32)
    proc = generate(bad)
    assert proc.returncode == 2 and "split.count" in proc.stderr, proc.stderr[-500:]


def test_a_missing_shards_message_stays_short(first_shard, tmp_path):
    """split.count = 65535 (the u16 maximum) beside no other shard.

    Symptom: exit 2, but the message lists all 65534 missing shard names: stderr is 1,572,926 characters
    (``error: ll-00002-of-65535.gguf, ll-00003-of-65535.gguf, ...``)."""
    bad = with_key(first_shard, tmp_path / "ll-00001-of-65535.gguf", SPLIT_COUNT, 65535, V.UINT16)
    proc = generate(bad)
    assert proc.returncode == 2
    assert len(proc.stderr) < 4000, f"stderr is {len(proc.stderr)} characters"


def test_a_split_count_that_is_an_array_is_refused_not_a_traceback(first_shard, tmp_path):
    """split.count stored as an array of strings.

    Symptom (exit 1, traceback): gguf_split.py ``_int``: ``int(field.parts[field.data[0]][0])`` ->
    ``IndexError: list index out of range`` (called from open_gguf's split_info)."""
    bad = with_key(first_shard, tmp_path / "ll-00001-of-00003.gguf", SPLIT_COUNT, ["3"], V.ARRAY, V.STRING)
    proc = generate(bad)
    assert proc.returncode == 2, proc.stderr[-800:]
    assert "Traceback" not in proc.stderr and "split.count" in proc.stderr


def test_a_split_count_that_is_a_string_is_not_read_as_its_first_byte(first_shard, tmp_path):
    """split.count stored as the string "3": ``_int`` takes the first byte of the string, ASCII 51.

    Symptom: exit 2 with a misleading message: ``ll-00001-of-00003.gguf is shard 1 of a 51-file split set but
    is not named PREFIX-00001-of-00051.gguf`` (the same for split.tensors.count "39": 'promises 51 tensors')."""
    bad = with_key(first_shard, tmp_path / "ll-00001-of-00003.gguf", SPLIT_COUNT, "3", V.STRING)
    proc = generate(bad)
    assert proc.returncode == 2
    assert "51" not in proc.stderr and "split.count" in proc.stderr, proc.stderr[-500:]


def test_a_shard_declaring_another_architecture_is_refused_naming_it(first_shard, tmp_path):
    """Shard 2 of the llama set rewritten to declare ``general.architecture`` qwen2 (and a
    qwen2.embedding_length of 999), same tensors, same split keys.

    Symptom (low): accepted silently; ``meshnet generate`` exits 0 and runs as llama. open_split compares
    split.no / split.count / tensor names only, so a shard of another model's set (whose tensor names and
    shapes happen to match) is not told apart from the set's own (README: 'a mismatched shard is refused at
    start-up, naming it')."""
    import os

    folder = tmp_path / "set"
    folder.mkdir()
    for i in (1, 3):
        name = f"ll-0000{i}-of-00003.gguf"
        os.link(first_shard.parent / name, folder / name)
    second = gguf.GGUFReader(first_shard.parent / "ll-00002-of-00003.gguf")
    w = gguf.GGUFWriter(str(folder / "ll-00002-of-00003.gguf"), "qwen2")
    w.add_uint16("split.no", 1)
    w.add_uint16("split.count", 3)
    w.add_int32("split.tensors.count", 39)
    w.add_uint32("qwen2.embedding_length", 999)
    for t in second.tensors:
        w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    proc = generate(folder / "ll-00001-of-00003.gguf")
    assert proc.returncode == 2 and "ll-00002-of-00003.gguf" in proc.stderr, proc.stderr[-300:]
