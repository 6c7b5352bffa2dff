"""Open a GGUF file safely and pick out the tensors one layer range needs.

Reading goes through the ``gguf`` package (``GGUFReader``, which memory-maps the file, so only the
tensors a stage copies out are ever paged in). Names come from gguf's own tables
(``gguf.TENSOR_NAMES``, ``gguf.MODEL_TENSOR``), never from string literals.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from meshnet.contract import LayerRange

GGUF_MAGIC = b"GGUF"

# Tensor types the ggml CPU kernels run directly (as stored, never dequantized up front).
SUPPORTED_TENSOR_TYPES = frozenset({
    gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16,
    gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q5_0,
    gguf.GGMLQuantizationType.Q5_1, gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q2_K,
    gguf.GGMLQuantizationType.Q3_K, gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K,
    gguf.GGMLQuantizationType.Q6_K,
    # DeepSeek-V4's routed experts (ggml's MXFP4 kernels) and its hash-routing tables (I32 expert ids,
    # read by get_rows only)
    gguf.GGMLQuantizationType.MXFP4, gguf.GGMLQuantizationType.I32,
})


class GGUFError(ValueError):
    """The file is not a usable GGUF: not GGUF at all, truncated, or of an unsupported kind."""


class _FastArrayReader(gguf.GGUFReader):
    """``GGUFReader`` with a fast path for array values.

    The stock reader creates two numpy views per array element, which takes over 20 s for a
    262k-token vocabulary.  Here a numeric array is one numpy view (``parts[data[0]]``), and a
    string array's parts end with ``[region, starts, lengths]``: the raw bytes of the whole array
    plus each string's byte offset (relative to ``region``) and length.  ``data`` is left
    empty for string arrays, so read them with :func:`string_array`, not ``contents()``.
    """

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[Any], list[int], list[gguf.GGUFValueType]]:
        if gguf.GGUFValueType(raw_type) != gguf.GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        offs = orig_offs + 12
        itype = gguf.GGUFValueType(int(raw_itype[0]))
        count = int(alen[0])
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is not None:
            values = self._get(offs, nptype, count)
            return offs + int(values.nbytes) - orig_offs, [raw_itype, alen, values], [2], \
                [gguf.GGUFValueType.ARRAY, itype]
        if itype != gguf.GGUFValueType.STRING:
            return super()._get_field_parts(orig_offs, raw_type)
        buf = memoryview(self.data)
        swapped = ">Q" if sys.byteorder == "little" else "<Q"
        unpack = struct.Struct("=Q" if self.byte_order == "I" else swapped).unpack_from
        begin = offs
        starts = []
        lengths = []
        for _ in range(count):
            (n,) = unpack(buf, offs)
            starts.append(offs + 8 - begin)
            lengths.append(n)
            offs += 8 + n
        region = self.data[begin:offs]
        return offs - orig_offs, [raw_itype, alen, region, starts, lengths], [], \
            [gguf.GGUFValueType.ARRAY, itype]


class _CheckedReader(_FastArrayReader):
    """GGUFReader that names the first tensor whose data runs past the end of a truncated file
    (the plain reader fails later with an anonymous numpy reshape error)."""

    def _build_tensors(self, start_offs, fields):  # type: ignore[override]
        size = len(self.data)
        for field in fields:
            _name_len, name_data, _n_dims, dims, raw_dtype, offset_tensor = field.parts
            name = bytes(name_data).decode("utf-8", "replace")
            try:
                qtype = gguf.GGMLQuantizationType(int(raw_dtype[0]))
            except ValueError:
                raise GGUFError(f"tensor {name!r} has unknown ggml type id {int(raw_dtype[0])}") from None
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            n_bytes = int(np.prod(dims)) * type_size // block
            end = int(start_offs + offset_tensor[0]) + n_bytes
            if end > size:
                raise GGUFError(f"truncated GGUF: tensor {name!r} needs bytes up to {end} but the file "
                                f"has only {size} bytes")
        super()._build_tensors(start_offs, fields)


_READERS: dict[tuple[str, int, int], gguf.GGUFReader] = {}
_READERS_LOCK = threading.Lock()


def _open_file(p: Path) -> gguf.GGUFReader:
    """One GGUF file, parsed once per process (see :func:`open_gguf`)."""
    if not p.is_file():
        raise FileNotFoundError(f"model file not found: {p}")
    with open(p, "rb") as f:
        magic = f.read(4)
    if not magic:
        raise GGUFError(f"{p} is not a GGUF file: it is empty")
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{p} is not a GGUF file: it starts with {magic!r}, expected {GGUF_MAGIC!r}")
    key = _stat_key(p)
    with _READERS_LOCK:
        reader = _READERS.get(key)
        if reader is None:
            try:
                reader = _CheckedReader(str(p), "r")
            except GGUFError as e:  # which file: a node loads a model and, fetching, its parts
                raise GGUFError(f"{p}: {e}") from None
            except (ValueError, IndexError, OverflowError, struct.error) as e:
                raise GGUFError(f"{p}: truncated or corrupt GGUF header ({e})") from None
            _READERS[key] = reader
        return reader


def _tensors_none_holds(model) -> str | None:
    """What the architecture's tensor table says is missing from ``model`` (None when nothing is)."""
    from meshnet.model.hparams import ModelConfig

    try:
        ModelConfig.from_reader(model)
    except GGUFError as e:
        return str(e)
    return None


def open_gguf(path: str | os.PathLike):
    """Open ``path`` read-only (memory-mapped), parsing its header once per process.

    Parsing is the slow part (a 49k-token vocabulary is ~100k metadata strings, seconds in gguf-py), so
    the tokenizer and every stage of one process share one reader, keyed by (path, size, mtime).

    A file that is a shard of a split set (``split.count`` > 1, named ``PREFIX-0000N-of-0000M.gguf``)
    opens the whole set: a :class:`meshnet.model.gguf_split.SplitGGUF`, which reads like a
    ``gguf.GGUFReader`` (metadata from the first shard, the tensors of every shard).

    Raises:
        FileNotFoundError: no such file.
        GGUFError: not a GGUF file (names the magic found), truncated (names the first tensor past the
            end), or a corrupt header; for a split set also a missing or mismatched shard, naming it (see
            :func:`meshnet.model.gguf_split.open_split`).
    """
    from meshnet.model.gguf_split import open_split, split_info

    p = Path(path)
    reader = _open_file(p)
    if split_info(reader)[1] > 1:
        return open_split(p, reader, _open_file, _tensors_none_holds)
    return reader


def string_array(reader: gguf.GGUFReader, key: str) -> list[str] | None:
    """The strings of an array-of-strings metadata value (None when the key is absent).

    Raises:
        GGUFError: the key holds something else, or a string that is not valid UTF-8.
    """
    field = reader.get_field(key)
    if field is None:
        return None
    if field.types != [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING]:
        raise GGUFError(f"GGUF key {key!r} is not an array of strings")
    region, starts, lengths = field.parts[-3:]
    raw = region.tobytes()
    try:
        return [raw[s:s + n].decode("utf-8") for s, n in zip(starts, lengths)]
    except UnicodeDecodeError as e:
        raise GGUFError(f"GGUF key {key!r} holds a string that is not valid UTF-8: {e}") from None


def array_length(reader: gguf.GGUFReader, key: str) -> int | None:
    """Element count of an array metadata value, without reading the elements."""
    field = reader.get_field(key)
    # parts: key length, key bytes, value type, item type, item count, items...
    return None if field is None else int(field.parts[4][0])


def drop_pages(reader) -> None:
    """Unmap the file pages this process touched (MADV_DONTNEED), so weights copied out of the memory
    map are not counted twice in the stage's resident memory. Later reads fault the pages back in.
    For a split set, every shard's pages."""
    for shard in getattr(reader, "shards", (reader,)):
        mm = getattr(shard.data, "_mmap", None)
        if mm is not None and hasattr(mmap, "MADV_DONTNEED"):
            mm.madvise(mmap.MADV_DONTNEED)


def _stat_key(path: str | os.PathLike) -> tuple[str, int, int]:
    st = os.stat(path)
    return os.path.realpath(path), st.st_size, st.st_mtime_ns


_HASH_CACHE: dict[tuple[str, int, int], str] = {}


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of the file's bytes (what benchmark records name a file by; a model's identity is
    :func:`meshnet.model.manifest.model_id`); cached per (path, size, mtime) within the process."""
    key = _stat_key(path)
    if key not in _HASH_CACHE:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        _HASH_CACHE[key] = h.hexdigest()
    return _HASH_CACHE[key]


def model_files(path: str | os.PathLike) -> tuple[Path, ...]:
    """The files a model is stored in: ``(path,)``, or every shard of the split set ``path`` is one of,
    in order. Raises as :func:`open_gguf`."""
    return tuple(getattr(open_gguf(path), "paths", (Path(path),)))


def model_tensors(reader) -> tuple:
    """The model's whole tensor list (each with ``name``, ``tensor_type``, ``shape`` ne0-first and
    ``n_bytes``): the reader's tensors, or for a range-only file the list it carries (it holds only
    some of them; see :mod:`meshnet.model.manifest`). Raises GGUFError when that list is malformed."""
    from meshnet.model.manifest import listed_tensors

    listed = listed_tensors(reader)
    return tuple(reader.tensors) if listed is None else listed


def tensor_name(kind: gguf.MODEL_TENSOR, layer: int | None = None, suffix: str = "weight") -> str:
    """The GGUF name of one tensor, from gguf's table: e.g. ``blk.3.attn_q.weight``."""
    base = gguf.TENSOR_NAMES[kind]
    return (base.format(bid=layer) if layer is not None else base) + "." + suffix


@dataclass(frozen=True)
class StageTensors:
    """The GGUF tensors one stage reads, by name. Layer tensors are ``blk.{i}.*`` for i in the range."""

    names: tuple[str, ...]
    total_bytes: int


def range_tensor_names(tensors, layers: LayerRange, n_layer: int, nextn: int = 0) -> tuple[str, ...]:
    """The names, among ``tensors`` (anything with ``.name``), that ``layers`` reads: ``blk.{i}.*`` for
    each owned layer, ``token_embd`` on the head, and ``output_norm`` plus ``output`` (and DeepSeek-V4's ``output_hc_*``) on the tail
    (``token_embd`` instead of ``output`` when the model is tied and has no ``output.weight``).
    ``nextn`` > 0: the tail also takes the ``nextn`` next-token-prediction blocks after the trunk, and
    ``token_embd`` (which they read unless they have ``nextn.embed_tokens``)."""
    present = [t.name for t in tensors]
    names = set(present)
    tail = layers.is_tail(n_layer)
    prefixes = tuple(f"blk.{i}." for i in range(layers.start, layers.end + (nextn if tail else 0)))
    wanted = [n for n in present if n.startswith(prefixes)]
    embd = tensor_name(gguf.MODEL_TENSOR.TOKEN_EMBD)
    out = tensor_name(gguf.MODEL_TENSOR.OUTPUT)
    if layers.is_head() or (tail and nextn):
        wanted.append(embd)
    if tail:
        wanted.append(tensor_name(gguf.MODEL_TENSOR.OUTPUT_NORM))
        wanted += [n for n in present if n.startswith("output_hc_")]  # DeepSeek-V4's last stream mix
        wanted.append(out if out in names else embd)
    return tuple(dict.fromkeys(n for n in wanted if n in names))


def stage_tensor_names(reader: gguf.GGUFReader, layers: LayerRange, n_layer: int, nextn: int = 0) -> StageTensors:
    """Select the tensors for ``layers`` (:func:`range_tensor_names`); for a range-only file from the
    model's whole tensor list (:func:`model_tensors`).

    Raises:
        GGUFError: a tensor type the ggml kernels do not run (names it and the supported ones), or a
            range-only file that lacks one of the selected tensors (names it).
    """
    by_name = {t.name: t for t in model_tensors(reader)}
    names = range_tensor_names(by_name.values(), layers, n_layer, nextn)
    held = {t.name for t in reader.tensors}
    absent = [n for n in names if n not in held]
    if absent:
        raise GGUFError(f"this range-only GGUF lacks tensor {absent[0]!r}, which layers {layers} need"
                        + (f" (and {len(absent) - 1} more)" if len(absent) > 1 else ""))
    for n in names:
        t = by_name[n]
        if t.tensor_type not in SUPPORTED_TENSOR_TYPES:
            supported = ", ".join(sorted(q.name for q in SUPPORTED_TENSOR_TYPES))
            raise GGUFError(f"tensor {n!r} has type {t.tensor_type.name}, which this engine does not run "
                            f"(supported: {supported})")
    return StageTensors(names, sum(int(by_name[n].n_bytes) for n in names))
