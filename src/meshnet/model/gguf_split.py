"""Split GGUF sets, as llama.cpp's ``gguf-split`` writes them, read as one model.

A set is ``PREFIX-00001-of-00003.gguf`` .. ``PREFIX-00003-of-00003.gguf``: each shard is a valid GGUF
with its own tensor list and data; every shard carries ``split.no`` (0-based) and ``split.count``, and
the first one carries the model's metadata and ``split.tensors.count`` (the tensors of the whole set).
Naming any one shard finds the others by that rule, as llama.cpp's ``llama_get_list_splits`` does
(llama.cpp itself insists on the first shard; here any shard will do, so every node of a mesh may be
given the file it happens to hold).

:class:`SplitGGUF` reads like a ``gguf.GGUFReader``: ``fields`` and ``get_field`` from the first shard,
``tensors`` the union over the shards in order, each tensor's ``data`` a view into its own shard's
memory map. :func:`shard_groups` says which shard holds which of a stage's tensors, so a stage wraps only
the shards it reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable

import gguf

from meshnet.model.gguf_file import GGUFError

SPLIT_NO = gguf.Keys.Split.LLM_KV_SPLIT_NO  # "split.no": this shard's 0-based index (u16)
SPLIT_COUNT = gguf.Keys.Split.LLM_KV_SPLIT_COUNT  # "split.count": shards in the set (u16)
SPLIT_TENSORS_COUNT = gguf.Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT  # "split.tensors.count": the set's tensors (i32)


def split_path(prefix: str, split_no: int, split_count: int) -> str:
    """The path of shard ``split_no`` (0-based) of ``split_count``: ``PREFIX-0000N-of-0000M.gguf``, N
    1-based.

    Mirrors llama.cpp's ``llama_split_path`` (``SPLIT_PATH_FORMAT`` ``"%s-%05d-of-%05d.gguf"``)."""
    return f"{prefix}-{split_no + 1:05d}-of-{split_count:05d}.gguf"


def split_prefix(path: str, split_no: int, split_count: int) -> str | None:
    """The set's prefix when ``path`` is named as shard ``split_no`` (0-based) of ``split_count``, else
    None (the name does not end in ``-0000N-of-0000M.gguf`` for those numbers).

    Mirrors llama.cpp's ``llama_split_prefix``."""
    postfix = f"-{split_no + 1:05d}-of-{split_count:05d}.gguf"
    if len(path) <= len(postfix) or not path.endswith(postfix):
        return None
    return path[:-len(postfix)]


# llama.cpp stores split.count as a u16: no set has more shards.
MAX_SHARDS = 65535
_INT_TYPES = {gguf.GGUFValueType.UINT8, gguf.GGUFValueType.INT8, gguf.GGUFValueType.UINT16,
              gguf.GGUFValueType.INT16, gguf.GGUFValueType.UINT32, gguf.GGUFValueType.INT32,
              gguf.GGUFValueType.UINT64, gguf.GGUFValueType.INT64}


def _int(reader: gguf.GGUFReader, key: str) -> int | None:
    """The integer ``key`` holds, None when absent. Raises GGUFError naming the key when it holds
    anything but one integer (an array, a string)."""
    field = reader.get_field(key)
    if field is None:
        return None
    if len(field.types) != 1 or field.types[0] not in _INT_TYPES or len(field.data) != 1:
        raise GGUFError(f"GGUF key {key!r} holds {'/'.join(t.name for t in field.types)}, expected one integer")
    return int(field.parts[field.data[0]][0])


def _arch(reader: gguf.GGUFReader) -> str | None:
    field = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    return None if field is None else str(field.contents())


def split_info(reader: gguf.GGUFReader) -> tuple[int, int]:
    """``(split.no, split.count)`` of one GGUF; ``(0, 0)`` for a file that is not part of a set."""
    return _int(reader, SPLIT_NO) or 0, _int(reader, SPLIT_COUNT) or 0


class SplitGGUF:
    """The shards of one split set, validated, read as one model.

    Attributes:
        paths: the shard files in order (``split.no`` 0 first).
        shards: one ``gguf.GGUFReader`` per shard, in the same order (each memory-maps its file).
        fields: the first shard's metadata (``gguf.ReaderField`` by key), as ``GGUFReader.fields``.
        tensors: every shard's ``gguf.ReaderTensor`` in shard order; ``data`` of each is a numpy view
            (its stored type's bytes or elements) into the memory map of the shard that holds it.
    """

    def __init__(self, paths: tuple[Path, ...], shards: tuple[gguf.GGUFReader, ...]) -> None:
        self.paths = paths
        self.shards = shards
        self.fields = shards[0].fields
        self.tensors = [t for shard in shards for t in shard.tensors]
        self._shard_of = {t.name: shard for shard in shards for t in shard.tensors}

    def get_field(self, key: str) -> gguf.ReaderField | None:
        """The first shard's metadata value under ``key`` (None when absent), as ``GGUFReader.get_field``."""
        return self.fields.get(key)

    def shard_of(self, name: str) -> gguf.GGUFReader:
        """The shard holding tensor ``name``. Raises KeyError when no shard holds it."""
        return self._shard_of[name]


def shard_groups(reader, names: Iterable[str]) -> list[tuple[gguf.GGUFReader, tuple[str, ...]]]:
    """``names`` grouped by the file that holds them: ``[(shard reader, names in it)]`` in shard order,
    only shards that hold at least one of them; ``[(reader, names)]`` for a single file."""
    names = tuple(names)
    if not isinstance(reader, SplitGGUF):
        return [(reader, names)]
    return [(shard, held) for shard in reader.shards
            if (held := tuple(n for n in names if reader.shard_of(n) is shard))]


def open_split(path: Path, named: gguf.GGUFReader, open_one: Callable[[Path], gguf.GGUFReader],
               promised_tensors: Callable[[SplitGGUF], str | None]) -> SplitGGUF:
    """Open and validate the whole set that ``path`` (already parsed as ``named``) is a shard of.

    Mirrors ``llama_model_loader``'s split branch (``llama_get_list_splits``, then each shard's
    ``split.no`` checked, duplicated tensor names refused, ``split.tensors.count`` compared with the
    tensors found), and also checks every shard's ``split.count``. ``open_one`` opens one file (cached,
    raising GGUFError naming a truncated tensor); ``promised_tensors`` names, for a set whose tensor count
    falls short, the tensors its architecture needs that no shard holds (None when it cannot tell).

    Raises:
        GGUFError: naming the file: a name that does not follow the shard rule for its own ``split.no`` /
            ``split.count``, a missing shard, a shard that is not GGUF or is truncated (naming its first
            tensor past the end), a shard whose ``split.no`` or ``split.count`` disagrees, a tensor
            held by two shards, or fewer/more tensors than ``split.tensors.count`` promises.
    """
    no, count = split_info(named)
    if count > MAX_SHARDS:
        raise GGUFError(f"{path.name}: split.count {count} is over llama.cpp's limit of {MAX_SHARDS} shards")
    if not 0 <= no < count:
        raise GGUFError(f"{path.name}: split.no {no} is outside its split.count {count}")
    prefix = split_prefix(str(path), no, count)
    if prefix is None:
        raise GGUFError(f"{path.name} is shard {no + 1} of a {count}-file split set but is not named "
                        f"{Path(split_path('PREFIX', no, count)).name}, so its other shards cannot be found")
    paths = tuple(Path(split_path(prefix, i, count)) for i in range(count))
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        names = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise GGUFError(f"{names} {'is' if len(missing) == 1 else 'are'} missing: {path.name} "
                        f"is one of a {count}-file split set, and every shard must be beside it")
    shards = []
    for i, p in enumerate(paths):
        try:
            shard = named if p == path else open_one(p)
        except (GGUFError, FileNotFoundError) as e:
            msg = str(e)
            raise GGUFError(msg if p.name in msg else f"{p.name}: {msg}") from None
        s_no, s_count = split_info(shard)
        if s_count != count:
            raise GGUFError(f"{p.name} has split.count {s_count} but {path.name} has {count}: the shards "
                            "come from different split sets")
        if s_no != i:
            raise GGUFError(f"{p.name} has split.no {s_no}, expected {i} (llama.cpp: invalid split file idx)")
        shards.append(shard)
    archs = [_arch(shard) for shard in shards]
    for p, arch in zip(paths, archs):
        if arch is not None and archs[0] is not None and arch != archs[0]:
            raise GGUFError(f"{p.name} declares architecture {arch!r} but {paths[0].name} {archs[0]!r}: the "
                            "shards come from different models")
    held: dict[str, Path] = {}
    for p, shard in zip(paths, shards):
        for t in shard.tensors:
            if t.name in held:
                raise GGUFError(f"tensor {t.name!r} is in both {held[t.name].name} and {p.name}")
            held[t.name] = p
    model = SplitGGUF(paths, tuple(shards))
    promised = _int(shards[0], SPLIT_TENSORS_COUNT)
    if promised is None:
        raise GGUFError(f"{paths[0].name} lacks the key {SPLIT_TENSORS_COUNT!r} a split set's first shard has")
    if promised != len(held):
        absent = promised_tensors(model) if promised > len(held) else None
        raise GGUFError(f"{paths[0].name} promises {promised} tensors ({SPLIT_TENSORS_COUNT}) but the "
                        f"{count} shards hold {len(held)}" + (f": {absent}" if absent else ""))
    return model
