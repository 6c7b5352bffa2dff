"""Split GGUF sets as llama.cpp's ``llama-gguf-split`` writes them: the bundled model split into shards
generates the same greedy ids as the single file, whichever shard is named, under one identity; a broken
set is refused at start-up with a message naming the shard or tensor (exit status 2), never a crash.

The set comes from llama.cpp's tool where it is built (``python -m meshnet.bench.llama_server``), else
from gguf-py's splitting writer, which a test checks writes the same layout as the tool."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from gguf_rewrite import rewrite_gguf
from meshnet.bench.llama_server import find_tool
from meshnet.contract import LayerRange
from meshnet.model.gguf_file import model_files, open_gguf, stage_tensor_names
from meshnet.model.manifest import model_id
from meshnet.model.gguf_split import SPLIT_COUNT, SPLIT_NO, SPLIT_TENSORS_COUNT, shard_groups, split_path

SPLIT_TOOL = find_tool("llama-gguf-split")
MAX_TENSORS = 80  # SmolLM2's 272 tensors in 4 shards: every stage of 3 reads from two or more
N_SHARDS = 4
PROMPT = "The capital of France is"

def meshnet(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshnet.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def greedy_ids(model: Path | str) -> list[int]:
    proc = meshnet("generate", "--model", str(model), "--stages", "3", "--temperature", "0", "--max-tokens",
                   "16", "--ignore-eos", "--json", PROMPT)
    assert proc.returncode == 0, proc.stderr
    return json_last_line(proc)["generated_token_ids"]


def json_last_line(proc: subprocess.CompletedProcess) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


def split_with_tool(model: Path, prefix: Path) -> None:
    """``llama-gguf-split --split --split-max-tensors 80 MODEL PREFIX``."""
    subprocess.run([str(SPLIT_TOOL), "--split", "--split-max-tensors", str(MAX_TENSORS), str(model), str(prefix)],
                   check=True, capture_output=True, timeout=120)


def split_with_gguf_py(model: Path, prefix: Path) -> None:
    """The same set written by gguf-py's own splitting writer (``GGUFWriter(split_max_tensors=...)``):
    the metadata and split keys on the first shard, the split keys alone on the others, the tensors in
    file order, ``PREFIX-0000N-of-0000M.gguf``; for machines where llama.cpp's tools are not built."""
    rewrite_gguf(model, prefix.with_name(prefix.name + ".gguf"), split_max_tensors=MAX_TENSORS)


@pytest.fixture(scope="module")
def split_dir(tmp_path_factory, smollm2_path) -> Path:
    """SmolLM2 split into ``smol-0000N-of-00004.gguf`` by llama-gguf-split, or by gguf-py where the tool
    is not built."""
    out = tmp_path_factory.mktemp("split")
    (split_with_tool if SPLIT_TOOL is not None else split_with_gguf_py)(smollm2_path, out / "smol")
    return out


def shard(folder: Path, no: int) -> Path:
    """Shard ``no`` (0-based) of the set in ``folder``."""
    return Path(split_path(str(folder / "smol"), no, N_SHARDS))


def broken_copy(split_dir: Path, folder: Path, changed: int) -> Path:
    """The set in ``folder``: hard links to ``split_dir``'s shards but a private copy of shard ``changed``
    (0-based) for the caller to break; returns that copy's path."""
    folder.mkdir()
    for i in range(N_SHARDS):
        (shutil.copyfile if i == changed else os.link)(shard(split_dir, i), shard(folder, i))
    return shard(folder, changed)


@pytest.mark.skipif(SPLIT_TOOL is None, reason="llama-gguf-split is not built: run `python -m "
                    "meshnet.bench.llama_server` (builds llama.cpp's tools into the cache)")
def test_gguf_py_writes_the_set_llama_gguf_split_writes(split_dir, smollm2_path, tmp_path):
    split_with_gguf_py(smollm2_path, tmp_path / "smol")
    for i in range(N_SHARDS):
        ours, tools = gguf.GGUFReader(shard(tmp_path, i)), gguf.GGUFReader(shard(split_dir, i))
        assert [t.name for t in ours.tensors] == [t.name for t in tools.tensors]
        assert shard(tmp_path, i).stat().st_size == shard(split_dir, i).stat().st_size
        for key in (SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS_COUNT):
            assert ours.get_field(key).contents() == tools.get_field(key).contents()
            assert ours.get_field(key).types == tools.get_field(key).types
    first = gguf.GGUFReader(shard(split_dir, 0))
    assert first.get_field(SPLIT_NO).contents() == 0 and first.get_field(SPLIT_COUNT).contents() == N_SHARDS
    assert first.get_field(SPLIT_TENSORS_COUNT).contents() == 272
    assert len(first.tensors) == MAX_TENSORS


def test_split_set_generates_what_the_single_file_does(split_dir, smollm2_path):
    single = greedy_ids(smollm2_path)
    assert len(single) == 16
    assert greedy_ids(shard(split_dir, 0)) == single
    assert greedy_ids(shard(split_dir, 1)) == single  # any shard names the set


def test_identity_is_the_same_whichever_shard_is_named(split_dir, smollm2_path):
    ids = {model_id(shard(split_dir, i)) for i in range(N_SHARDS)}
    assert ids == {model_id(smollm2_path)}  # the manifest's id: the single file's too
    assert model_files(shard(split_dir, 2)) == tuple(shard(split_dir, i) for i in range(N_SHARDS))


@pytest.mark.parametrize("use_mmap", [True, False])
def test_a_stage_wraps_only_the_shards_holding_its_tensors(split_dir, smollm2_path, use_mmap):
    import ctypes

    import ggml
    import numpy as np

    from meshnet.engine.ggml_backend import StageWeights, cpu_backend, release_cpu_backend

    split, single = open_gguf(shard(split_dir, 1)), open_gguf(smollm2_path)
    layers = LayerRange(12, 25)
    names = stage_tensor_names(split, layers, 30).names
    assert names == stage_tensor_names(single, layers, 30).names
    held = shard_groups(split, names)
    assert 1 < len(held) < N_SHARDS  # the middle stage reads two of the four shards
    weights = StageWeights(split, names, cpu_backend(1), use_mmap=use_mmap)
    try:
        assert len(weights.buffers) == (len(held) if use_mmap else 1)
        stored = {t.name: t for t in single.tensors}
        for name in names:
            t = weights.get(name)
            out = np.empty(ggml.ggml_nbytes(t), dtype=np.uint8)
            ggml.ggml_backend_tensor_get(t, out.ctypes.data_as(ctypes.c_void_p), 0, out.nbytes)
            assert out.tobytes() == stored[name].data.tobytes(), name
    finally:
        weights.free()
        release_cpu_backend()


def refused(model: Path, message: str) -> None:
    """``generate`` and ``node`` both exit 2 naming the problem, before loading or registering anything."""
    proc = meshnet("generate", "--model", str(model), "--stages", "3", PROMPT)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr and "stage(s)" not in proc.stderr
    # Port 1 has no tracker: a node that tried to register would keep retrying instead of exiting 2.
    node = meshnet("node", "--model", str(model), "--layers", "0:12", "--tracker", "127.0.0.1:1", timeout=60)
    assert node.returncode == 2, node.stderr
    assert message in node.stderr


def test_a_missing_shard_is_named(split_dir, tmp_path):
    folder = tmp_path / "set"
    folder.mkdir()
    for i in (0, 2, 3):
        os.link(shard(split_dir, i), shard(folder, i))
    refused(shard(folder, 2), "smol-00002-of-00004.gguf is missing")


def test_a_shard_of_another_set_is_named(split_dir, tmp_path):
    bad = broken_copy(split_dir, tmp_path / "set", 1)
    reader = gguf.GGUFReader(bad, "r+")  # edit split.count in place, as gguf's gguf_set_metadata does
    field = reader.get_field(SPLIT_COUNT)
    field.parts[field.data[0]][0] = N_SHARDS + 1
    reader.data.flush()
    del reader
    refused(shard(bad.parent, 0), "smol-00002-of-00004.gguf has split.count 5 but smol-00001-of-00004.gguf has 4")


def test_a_truncated_shard_is_named_with_its_first_tensor_past_the_end(split_dir, tmp_path):
    bad = broken_copy(split_dir, tmp_path / "set", 2)
    os.truncate(bad, bad.stat().st_size - 1000)
    last = gguf.GGUFReader(shard(split_dir, 2)).tensors[-1].name
    refused(shard(bad.parent, 0), f"smol-00003-of-00004.gguf: truncated GGUF: tensor {last!r}")


def test_a_tensor_no_shard_holds_is_named(split_dir, tmp_path):
    bad = broken_copy(split_dir, tmp_path / "set", N_SHARDS - 1)
    original = gguf.GGUFReader(shard(split_dir, N_SHARDS - 1))
    dropped = original.tensors[-1].name
    # The last shard written again without its last tensor, keeping its split keys (as gguf-split
    # writes a shard after the first: the split keys and its tensors).
    w = gguf.GGUFWriter(bad, arch="llama")
    w.add_uint16(SPLIT_NO, N_SHARDS - 1)
    w.add_uint16(SPLIT_COUNT, N_SHARDS)
    w.add_int32(SPLIT_TENSORS_COUNT, 272)
    for t in original.tensors[:-1]:
        w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    refused(shard(bad.parent, 1), "promises 272 tensors (split.tensors.count) but the 4 shards hold 271")
    proc = meshnet("generate", "--model", str(shard(bad.parent, 0)), PROMPT)
    assert f"missing tensor {dropped!r}" in proc.stderr
