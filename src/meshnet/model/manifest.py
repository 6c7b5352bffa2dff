"""A model's identity, however it is stored: its manifest and the manifest's sha256.

The manifest is the model's metadata (every GGUF key/value except storage bookkeeping: the split keys,
``general.alignment`` and this module's own key) plus its tensor list, each tensor as (name, ggml type,
shape ne0-first, sha256 of its stored bytes). Its canonical encoding is JSON with sorted keys and no
whitespace (tensors sorted by name); the model id is the hex sha256 of that encoding. A single file, a
split set (:mod:`meshnet.model.gguf_split`) and a range-only file (the tensors of some layers, see
:mod:`meshnet.model.range_file`) of one model have the same manifest, hence the same id.

A range-only file cannot derive the full tensor list from what it holds, so it carries it under
:data:`MANIFEST_TENSORS_KEY` (JSON); its metadata is its own keys. Opening one checks that every tensor it
holds is in that list with the same type and shape, and :func:`model_manifest` that its bytes hash to the
listed sha256.

Values are encoded ``[type, value]`` (``["ARRAY", item type, [values]]`` for arrays) with gguf's
``GGUFValueType`` names, so a manifest can be written back into a GGUF key for key
(:func:`meshnet.model.range_file.write_header`). Strings that are not UTF-8 travel as surrogate escapes.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import gguf

from meshnet.model.gguf_file import GGUFError, _stat_key, open_gguf, string_array

MANIFEST_TENSORS_KEY = "meshnet.manifest.tensors"
V = gguf.GGUFValueType
# Storage bookkeeping, not the model: how it is cut into files and padded.
_EXCLUDED = {gguf.Keys.Split.LLM_KV_SPLIT_NO, gguf.Keys.Split.LLM_KV_SPLIT_COUNT,
             gguf.Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT, gguf.Keys.General.ALIGNMENT, MANIFEST_TENSORS_KEY}
# A manifest travels zlib-compressed; this bounds what one may inflate to (a 262k vocabulary is ~10 MB).
MAX_MANIFEST_BYTES = 256 << 20
_HASH_BLOCK = 8 << 20


@dataclass(frozen=True)
class ManifestTensor:
    """One tensor of the model. ``shape``: dims ne0-first (as ``ReaderTensor.shape``); ``sha256``: hex
    of its stored bytes (``n_bytes`` of them)."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    sha256: str

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n

    @property
    def n_bytes(self) -> int:
        block, type_size = gguf.GGML_QUANT_SIZES[self.tensor_type]
        return self.n_elements * type_size // block

    def encode(self) -> dict:
        return {"name": self.name, "type": self.tensor_type.name, "shape": list(self.shape), "sha256": self.sha256}

    @classmethod
    def decode(cls, d: dict) -> "ManifestTensor":
        try:
            shape = tuple(int(x) for x in d["shape"])
            if any(n < 0 for n in shape):
                raise ValueError(f"negative dimension in shape {shape}")
            return cls(str(d["name"]), gguf.GGMLQuantizationType[d["type"]], shape, str(d["sha256"]))
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise GGUFError(f"manifest tensor entry {d!r:.120} is malformed ({e!r})") from None


@dataclass(frozen=True)
class ModelManifest:
    """Metadata (key -> encoded value, see the module docstring) and tensors sorted by name."""

    metadata: dict
    tensors: tuple[ManifestTensor, ...]

    def canonical(self) -> bytes:
        """The canonical encoding (UTF-8 JSON, sorted keys, no whitespace) the id hashes."""
        return json.dumps({"metadata": self.metadata, "tensors": [t.encode() for t in self.tensors]},
                          sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()

    @property
    def id(self) -> str:
        """The model id: hex sha256 of :meth:`canonical`."""
        return hashlib.sha256(self.canonical()).hexdigest()

    @property
    def name(self) -> str:
        """``general.name``, or "" when the metadata has none."""
        v = self.metadata.get(gguf.Keys.General.NAME)
        return str(v[1]) if v and v[0] == "STRING" else ""

    def by_name(self) -> dict[str, ManifestTensor]:
        return {t.name: t for t in self.tensors}

    def compressed(self) -> bytes:
        """zlib of :meth:`canonical`: what the tracker stores and serves."""
        return zlib.compress(self.canonical(), 6)

    @classmethod
    def from_canonical(cls, raw: bytes) -> "ModelManifest":
        """Decode :meth:`canonical` bytes. Raises GGUFError when they are not a manifest."""
        try:
            d = json.loads(raw)
            meta, tensors = d["metadata"], d["tensors"]
            if not isinstance(meta, dict) or not isinstance(tensors, list):
                raise TypeError("metadata must be an object and tensors a list")
        except (ValueError, KeyError, TypeError) as e:
            raise GGUFError(f"not a model manifest ({e})") from None
        except RecursionError:  # '[[[[...' inflated from a few bytes
            raise GGUFError("not a model manifest (JSON nested too deeply)") from None
        return cls(meta, tuple(sorted((ManifestTensor.decode(t) for t in tensors), key=lambda t: t.name)))

    @classmethod
    def from_compressed(cls, blob: bytes, expect_id: str | None = None) -> "ModelManifest":
        """Inflate and decode :meth:`compressed` bytes (at most :data:`MAX_MANIFEST_BYTES`).

        Raises:
            GGUFError: not zlib, too large, not a manifest, or (``expect_id``) a manifest of another id.
        """
        z = zlib.decompressobj()
        try:
            raw = z.decompress(blob, MAX_MANIFEST_BYTES)
        except zlib.error as e:
            raise GGUFError(f"manifest is not zlib data ({e})") from None
        if z.unconsumed_tail:
            raise GGUFError(f"manifest inflates past {MAX_MANIFEST_BYTES} bytes")
        m = cls.from_canonical(raw)
        if expect_id is not None and hashlib.sha256(raw).hexdigest() != expect_id:
            raise GGUFError(f"manifest hashes to {hashlib.sha256(raw).hexdigest()}, not the model id {expect_id}")
        return m


def encode_value(reader, key: str, field) -> list:
    """``[type, value]`` / ``["ARRAY", item type, values]`` of one metadata field.

    Raises:
        GGUFError: a nested array or a value gguf-py cannot read, naming the key."""
    vt = field.types[0]
    if vt != V.ARRAY:
        if vt == V.STRING:
            return [vt.name, bytes(field.parts[field.data[0]]).decode("utf-8", "surrogateescape")]
        return [vt.name, field.parts[field.data[0]][0].item()]
    item = field.types[1] if len(field.types) > 1 else None
    if item == V.STRING:
        return [V.ARRAY.name, item.name, string_array(reader, key)]
    if item is None or len(field.types) != 2:
        raise GGUFError(f"GGUF key {key!r} is a nested or untyped array, which a manifest cannot hold")
    if field.data:  # the fast reader: one numpy view of the whole array
        return [V.ARRAY.name, item.name, field.parts[field.data[0]].tolist()]
    return [V.ARRAY.name, item.name, []]


def metadata_of(reader) -> dict:
    """The manifest metadata of a reader (for a split set: its first shard's), bookkeeping keys dropped."""
    return {k: encode_value(reader, k, f) for k, f in reader.fields.items()
            if not k.startswith("GGUF.") and k not in _EXCLUDED}


def listed_tensors(reader) -> tuple[ManifestTensor, ...] | None:
    """The full tensor list a range-only file carries (None for any other file). Raises GGUFError when
    the key does not hold one, or names a tensor twice."""
    field = reader.get_field(MANIFEST_TENSORS_KEY)
    if field is None:
        return None
    try:
        entries = json.loads(bytes(field.parts[field.data[0]]).decode())
    except (ValueError, IndexError, RecursionError) as e:  # RecursionError: arrays nested too deep to parse
        raise GGUFError(f"GGUF key {MANIFEST_TENSORS_KEY!r} does not hold a JSON tensor list ({e})") from None
    if not isinstance(entries, list):
        raise GGUFError(f"GGUF key {MANIFEST_TENSORS_KEY!r} does not hold a JSON tensor list")
    listed = tuple(sorted((ManifestTensor.decode(e) for e in entries), key=lambda t: t.name))
    twice = next((a.name for a, b in zip(listed, listed[1:]) if a.name == b.name), None)
    if twice is not None:
        raise GGUFError(f"GGUF key {MANIFEST_TENSORS_KEY!r} lists tensor {twice!r} twice")
    return listed


def check_held(reader, listed: tuple[ManifestTensor, ...], where: str) -> None:
    """Refuse a range-only file holding a tensor its list lacks, or of another type or shape (GGUFError
    naming ``where`` and the tensor)."""
    by_name = {t.name: t for t in listed}
    for t in reader.tensors:
        m = by_name.get(t.name)
        if m is None:
            raise GGUFError(f"{where}: tensor {t.name!r} is not in the model manifest it carries")
        if t.tensor_type != m.tensor_type or tuple(int(d) for d in t.shape) != m.shape:
            held = [int(d) for d in t.shape]
            raise GGUFError(f"{where}: tensor {t.name!r} is {t.tensor_type.name} {held}, the manifest "
                            f"says {m.tensor_type.name} {list(m.shape)}")


def _locations(reader, path: Path) -> list[tuple[str, str, int, int]]:
    """(name, file, absolute offset, n_bytes) of every tensor the reader holds."""
    shards = getattr(reader, "shards", None)
    if shards is None:
        return [(t.name, str(path), int(t.data_offset), int(t.n_bytes)) for t in reader.tensors]
    return [(t.name, str(p), int(t.data_offset), int(t.n_bytes))
            for p, shard in zip(reader.paths, shards) for t in shard.tensors]


def hash_range(fd: int, offset: int, n_bytes: int) -> str:
    """Hex sha256 of ``n_bytes`` at ``offset`` of open file ``fd`` (pread in 8 MiB blocks, so the file
    is not mapped into this process's resident memory). Raises GGUFError when the file ends first."""
    h = hashlib.sha256()
    end = offset + n_bytes
    while offset < end:
        block = os.pread(fd, min(_HASH_BLOCK, end - offset), offset)
        if not block:
            raise GGUFError(f"file ends at byte {offset}, before the tensor's last byte {end}")
        h.update(block)  # releases the GIL: tensors hash in parallel threads
        offset += len(block)
    return h.hexdigest()


def hash_tensors(locations: list[tuple[str, str, int, int]]) -> dict[str, str]:
    """sha256 of each tensor's bytes, name -> hex: one pass over the data, tensors spread over threads
    (one per CPU, at most 8). Raises GGUFError naming a tensor whose file ends early."""
    fds = {f: os.open(f, os.O_RDONLY) for f in {loc[1] for loc in locations}}

    def one(loc):
        name, f, off, n = loc
        try:
            return name, hash_range(fds[f], off, n)
        except GGUFError as e:
            raise GGUFError(f"{Path(f).name}: tensor {name!r}: {e}") from None

    try:
        with ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1))) as pool:
            return dict(pool.map(one, sorted(locations, key=lambda loc: -loc[3])))
    finally:
        for fd in fds.values():
            os.close(fd)


_CACHE: dict[tuple, ModelManifest] = {}
_CACHE_LOCK = threading.Lock()


def model_manifest(path: str | os.PathLike) -> ModelManifest:
    """The manifest of the model stored at ``path`` (a file, any shard of a split set, or a range-only
    file), computed once per process for the same files (path, size, mtime).

    A 3.8 GB file costs one read of its tensor data, hashed on up to 8 threads (the file's sha256 it
    replaces was one thread over the same bytes).

    Raises:
        FileNotFoundError, GGUFError: as :func:`meshnet.model.gguf_file.open_gguf`; for a range-only file
            also a held tensor that is not in its list, of another type or shape, or whose bytes do not
            hash to the listed sha256 (naming the file and the tensor).
    """
    p = Path(path)
    reader = open_gguf(p)
    files = getattr(reader, "paths", (p,))
    key = tuple(_stat_key(f) for f in files)
    with _CACHE_LOCK:
        if key in _CACHE:
            return _CACHE[key]
    listed = listed_tensors(reader)
    hashes = hash_tensors(_locations(reader, p))
    if listed is None:
        tensors = tuple(sorted((ManifestTensor(t.name, t.tensor_type, tuple(int(d) for d in t.shape), hashes[t.name])
                                for t in reader.tensors), key=lambda t: t.name))
    else:
        check_held(reader, listed, p.name)
        by_name = {t.name: t for t in listed}
        for name, sha in hashes.items():
            if by_name[name].sha256 != sha:
                raise GGUFError(f"{p.name}: tensor {name!r} is corrupt: its bytes hash to {sha[:16]}..., the "
                                f"manifest says {by_name[name].sha256[:16]}...")
        tensors = listed
    m = ModelManifest(metadata_of(reader), tensors)
    with _CACHE_LOCK:
        _CACHE[key] = m
    return m


def model_id(path: str | os.PathLike) -> str:
    """The model's id (hex sha256 of its manifest's canonical encoding). Raises as :func:`model_manifest`."""
    return model_manifest(path).id
