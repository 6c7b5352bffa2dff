"""Range-only GGUF files: the metadata of a model and the tensors of some of its layers.

Such a file is a valid GGUF (gguf-py and this engine read it) whose metadata is the model manifest's
(:mod:`meshnet.model.manifest`) plus the whole tensor list under ``meshnet.manifest.tensors``, so its
manifest, and id, is the full model's. It is written in two steps so a fetch can resume: the header
(gguf-py's ``GGUFWriter``, deterministic for one manifest and tensor selection) with the data area sized
but empty, then each tensor's bytes at its offset as they arrive. A partial file keeps the name
``<final>.part`` until every tensor is in place and verified.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from meshnet.model.gguf_file import GGUFError
from meshnet.model.manifest import MANIFEST_TENSORS_KEY, ManifestTensor, ModelManifest, hash_range

# gguf-py's writer logs at INFO what it writes ("This GGUF file is for Little Endian only", the files and
# their sizes): here a scratch header's, which is nothing a user asked for.
logging.getLogger("gguf.gguf_writer").setLevel(logging.WARNING)

ALIGNMENT = gguf.GGUF_DEFAULT_ALIGNMENT
V = gguf.GGUFValueType


@dataclass(frozen=True)
class RangeLayout:
    """Where each tensor of a range-only file lives.

    Attributes:
        header: the file's bytes before the data area (header, metadata, tensor infos, padding).
        offsets: tensor name -> absolute byte offset of its data, in file order.
        tensors: the selected tensors, in file order.
        size: the whole file's size in bytes (each tensor padded to :data:`ALIGNMENT`).
    """

    header: bytes
    offsets: dict[str, int]
    tensors: tuple[ManifestTensor, ...]
    size: int


def _value(vt: str, item: str | None, value):
    if vt == V.STRING.name:
        return value.encode("utf-8", "surrogateescape")
    if vt == V.ARRAY.name and item == V.STRING.name:
        return [s.encode("utf-8", "surrogateescape") for s in value]
    return value


def layout(manifest: ModelManifest, names) -> RangeLayout:
    """The layout of the range-only file holding ``names`` (in manifest order) of ``manifest``.

    Raises:
        GGUFError: a name that is not in the manifest, or a metadata value gguf-py cannot write.
    """
    by_name = manifest.by_name()
    missing = [n for n in names if n not in by_name]
    if missing:
        raise GGUFError(f"tensor {missing[0]!r} is not in the model manifest")
    chosen = tuple(t for t in manifest.tensors if t.name in set(names))
    arch = manifest.metadata.get(gguf.Keys.General.ARCHITECTURE, [None, ""])[1]
    with tempfile.TemporaryDirectory(prefix="meshnet-header-") as tmp:
        header = _header(manifest, chosen, arch, Path(tmp) / "h.gguf")
    offsets, pos = {}, len(header)
    for t in chosen:
        offsets[t.name] = pos
        pos += gguf.GGUFWriter.ggml_pad(t.n_bytes, ALIGNMENT)
    return RangeLayout(header, offsets, chosen, pos)


def _header(manifest: ModelManifest, chosen: tuple[ManifestTensor, ...], arch: str, tmp: Path) -> bytes:
    """The header bytes gguf-py's writer produces (written to ``tmp``), padded to the data area."""
    w = gguf.GGUFWriter(str(tmp), arch)
    try:
        for key, enc in manifest.metadata.items():
            if key == gguf.Keys.General.ARCHITECTURE:
                continue  # the writer adds it itself
            vt, item = enc[0], (enc[1] if enc[0] == V.ARRAY.name else None)
            w.add_key_value(key, _value(vt, item, enc[-1]), V[vt], V[item] if item else None)
        w.add_key_value(MANIFEST_TENSORS_KEY, json.dumps([t.encode() for t in manifest.tensors],
                                                         separators=(",", ":")), V.STRING)
        for t in chosen:
            # numpy order (outermost first); a non-uint8 dtype keeps gguf-py from reading it as bytes
            w.add_tensor_info(t.name, tuple(reversed(t.shape)), np.dtype(np.float32), t.n_bytes, t.tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise GGUFError(f"the manifest's metadata cannot be written as GGUF ({e!r})") from None
    finally:
        w.close()
    raw = tmp.read_bytes()
    return raw + bytes(gguf.GGUFWriter.ggml_pad(len(raw), ALIGNMENT) - len(raw))


def open_part(path: Path, lay: RangeLayout) -> tuple[int, set[str]]:
    """Open (creating or resuming) the partial file ``path`` for ``lay``; return its descriptor and the
    names of the tensors already in it whose bytes hash to the manifest's sha256.

    A file whose header differs from ``lay.header`` (another model or range) is started afresh."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    done: set[str] = set()
    if os.fstat(fd).st_size == lay.size and os.pread(fd, len(lay.header), 0) == lay.header:
        for t in lay.tensors:
            try:
                if hash_range(fd, lay.offsets[t.name], t.n_bytes) == t.sha256:
                    done.add(t.name)
            except GGUFError:
                pass
        return fd, done
    os.ftruncate(fd, 0)
    os.pwrite(fd, lay.header, 0)
    os.ftruncate(fd, lay.size)
    return fd, done


def range_file_name(manifest: ModelManifest, start: int, end: int) -> str:
    """``<name>-<id12>-L<start>-<end>.gguf``: one file per model and range in a models directory."""
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in manifest.name)[:48] or "model"
    return f"{stem}-{manifest.id[:12]}-L{start}-{end}.gguf"


def write_metadata_file(manifest: ModelManifest, path: str | os.PathLike) -> Path:
    """A range-only file holding no tensors: the model's metadata (tokenizer, chat template, hyper-
    parameters) and tensor list, for a client that tokenizes without the weights. Written atomically."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + f".{os.getpid()}.tmp")
    tmp.write_bytes(layout(manifest, ()).header)
    os.replace(tmp, p)
    return p
