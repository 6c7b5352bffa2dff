"""What a node hands a peer that fetches its layers: the stored bytes of named tensors of its model.

Served by ``Node.FetchTensors`` (:class:`meshnet.node.service.NodeService`) from the node's own file(s),
memory-mapped (a single file, a split set or a range-only file alike), in chunks of at most
:data:`CHUNK_BYTES`, so no message comes near gRPC's limit whatever the tensor's size. The fetching
side verifies every tensor against the model manifest (:mod:`meshnet.node.fetch`).
"""

from __future__ import annotations

import threading
from typing import Iterator

from meshnet.model.gguf_file import drop_pages, open_gguf
from meshnet.proto import meshnet_pb2 as pb

CHUNK_BYTES = 1 << 20
MAX_NAMES = 65536  # a 235B MoE has ~20k tensors
# Each stream holds one of the node's gRPC workers for as long as its client takes to read it (a slow link,
# or a peer that stops reading): more at once would leave none for Step, Health and the other calls.
MAX_FETCHES = 2


class TensorRequestError(ValueError):
    """A request this node cannot answer. ``code``: the gRPC status code name to answer with."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class TensorSource:
    """The tensors of the model stored at ``path`` (whose id is ``model_id``), to at most ``max_fetches``
    streams at once."""

    def __init__(self, path: str, model_id: str, max_fetches: int = MAX_FETCHES) -> None:
        self.path, self.model_id, self.max_fetches = path, model_id, max_fetches
        self._slots = threading.BoundedSemaphore(max_fetches)
        self._held: dict | None = None  # tensor name -> the file's tensor, read from the header once
        self._reader = None
        self._lock = threading.Lock()

    def _tensors(self):
        """``(reader, {name: tensor})`` of the node's file, opened on the first fetch and kept (the header
        of a large model lists tens of thousands of tensors; each fetch used to parse it again)."""
        with self._lock:
            if self._held is None:
                self._reader = open_gguf(self.path)
                self._held = {t.name: t for t in self._reader.tensors}
            return self._reader, self._held

    def chunks(self, request: pb.TensorRequest) -> Iterator[pb.TensorChunk]:
        """The chunks of each requested tensor this node holds, in request order, offsets ascending.

        Raises:
            TensorRequestError: another model (FAILED_PRECONDITION), or a request naming a tensor twice
                or more than :data:`MAX_NAMES` tensors (INVALID_ARGUMENT), or ``max_fetches`` streams
                already being served (RESOURCE_EXHAUSTED; the fetching side tries its next peer).
        """
        # what the request names is echoed clipped: gRPC drops a reply whose error details pass 16 KiB
        if request.model_id != self.model_id:
            raise TensorRequestError("FAILED_PRECONDITION", f"this node serves model {self.model_id}, not "
                                                            f"{request.model_id!r:.80}")
        names = list(request.names)
        if len(names) > MAX_NAMES:
            raise TensorRequestError("INVALID_ARGUMENT", f"{len(names)} tensors asked; at most {MAX_NAMES}")
        seen: set[str] = set()
        twice = next((n for n in names if n in seen or seen.add(n)), None)
        if twice is not None:
            raise TensorRequestError("INVALID_ARGUMENT", f"tensor {twice!r:.80} is named twice")
        if not self._slots.acquire(blocking=False):
            raise TensorRequestError("RESOURCE_EXHAUSTED", f"this node is serving {self.max_fetches} fetches "
                                                           f"already, its limit; fetch from another peer or later")
        reader = None
        try:
            reader, held = self._tensors()
            for name in names:
                t = held.get(name)
                if t is None:
                    continue
                flat = t.data.reshape(-1).view("u1")  # the stored bytes, whatever the type
                total = int(flat.nbytes)
                for off in range(0, total, CHUNK_BYTES):
                    yield pb.TensorChunk(name=name, offset=off, total_bytes=total,
                                         data=flat[off:off + CHUNK_BYTES].tobytes())
        finally:
            self._slots.release()
            if reader is not None:
                drop_pages(reader)  # the pages read for a peer are not this node's working set
