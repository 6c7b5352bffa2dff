"""Copies of a GGUF with metadata or tensors changed, or split into shards, through gguf-py's writer
(the bad-file and split-set tests)."""

from __future__ import annotations

import functools
from pathlib import Path

import gguf

V = gguf.GGUFValueType


def rewrite_gguf(src: Path, dst: Path, fields: dict | None = None, typed: dict | None = None, tensors=None,
                 split_max_tensors: int = 0) -> Path:
    """``src`` copied to ``dst`` with ``fields`` ({key: value}) replaced in place or added at the end
    (``typed[key]``: (value type, item type) for a new key or a changed type) and each tensor passed
    through ``tensors(name, data, type) -> (data, type, raw_shape)``. ``split_max_tensors`` > 0: written
    as a split set of that many tensors a shard, as gguf-py splits (``dst`` names the set:
    ``PREFIX.gguf`` gives ``PREFIX-0000N-of-0000M.gguf``)."""
    fields, typed = fields or {}, typed or {}
    stat = Path(src).stat()
    arch, kvs, r = _read(Path(src).resolve(), stat.st_mtime_ns, stat.st_size)
    w = gguf.GGUFWriter(str(dst), arch, split_max_tensors=split_max_tensors)
    done = set()
    for key, vt, sub, val in kvs:
        if key in fields:
            done.add(key)
            val = fields[key]
            vt, sub = typed.get(key, (vt, sub))
        w.add_key_value(key, val, vt, sub)
    for key, val in fields.items():
        if key not in done:
            w.add_key_value(key, val, *typed[key])
    for t in r.tensors:
        data, tt, shape = t.data, t.tensor_type, t.data.shape
        if tensors is not None:
            data, tt, shape = tensors(t.name, t.data, t.tensor_type)
        w.add_tensor(t.name, data, raw_shape=shape, raw_dtype=tt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@functools.lru_cache(maxsize=4)
def _read(src: Path, mtime_ns: int, size: int) -> tuple[str, list, gguf.GGUFReader]:
    """``src``'s architecture (a file whose mtime and size are as given), its key-values as ``(key, value type, item type, value)`` and its reader
    (for the tensors), parsed once per test session: gguf-py takes about 2 s to parse a 49k-token vocabulary,
    and the bad-file tests rewrite the same golden models over and over."""
    r = gguf.GGUFReader(src)
    kvs = []
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == gguf.Keys.General.ARCHITECTURE:
            continue  # the header's own fields; the architecture the writer adds itself
        vt = f.types[0]
        kvs.append((key, vt, f.types[-1] if vt == V.ARRAY else None, f.contents()))
    return r.get_field(gguf.Keys.General.ARCHITECTURE).contents(), kvs, r
