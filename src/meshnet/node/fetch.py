"""Fetch only your layers: build a range-only GGUF from peers that serve the same model.

A node started with ``--layers A:B --fetch MODEL`` and no model file reads the model's manifest from the
tracker (:mod:`meshnet.tracker.manifests`), picks the tensors its range reads
(:func:`meshnet.model.gguf_file.range_tensor_names`: the range's blocks, ``token_embd`` on the head,
``output_norm`` and ``output`` on the tail), and streams exactly those from peers (``Node.FetchTensors``)
into a range-only file (:mod:`meshnet.model.range_file`). Every tensor's bytes are checked against the
manifest's sha256 before they count; a peer whose bytes do not verify is refused, naming the tensor. The
file is ``<name>.part`` until complete, and a fetch that was interrupted resumes: tensors already in the
part file that verify are not fetched again.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import grpc
from tqdm import tqdm

from meshnet.contract import LayerRange
from meshnet.model.gguf_file import GGUFError, range_tensor_names
from meshnet.model.manifest import ModelManifest, model_manifest
from meshnet.model.range_file import layout, open_part, range_file_name
from meshnet.proto import meshnet_pb2 as pb
from meshnet.proto import meshnet_pb2_grpc as pb_grpc

log = logging.getLogger("meshnet.fetch")
# A peer serves few fetches at once (meshnet.node.tensor_source.MAX_FETCHES): nodes joining together
# wait their turn rather than fail.
BUSY_RETRY_S = 1.0
BUSY_WAIT_S = 600.0


class FetchError(ValueError):
    """The range could not be completed: every peer failed or refused (the message says how each did,
    naming a tensor whose bytes did not verify). The part file keeps what did verify."""


@dataclass(frozen=True)
class FetchResult:
    """A completed fetch. ``bytes_moved``: tensor bytes received from peers in this call (corrupt ones
    included); ``range_bytes``: the tensor bytes the range reads in all."""

    path: Path
    model_id: str
    bytes_moved: int
    range_bytes: int


def n_layer_of(manifest: ModelManifest) -> tuple[int, int]:
    """``(trunk layers, next-token-prediction blocks)`` of the manifest: ``{arch}.block_count`` counts
    both, ``{arch}.nextn_predict_layers`` the latter (as :class:`meshnet.model.hparams.ModelConfig`
    reads them). Raises GGUFError when the block count is absent."""
    arch = manifest.metadata.get("general.architecture", [None, ""])[1]
    v = manifest.metadata.get(f"{arch}.block_count")
    if v is None or not isinstance(v[-1], int):
        raise GGUFError(f"the manifest of {manifest.id} has no {arch}.block_count")
    nextn = manifest.metadata.get(f"{arch}.nextn_predict_layers")
    n_nextn = int(nextn[-1]) if nextn is not None and isinstance(nextn[-1], int) else 0
    return int(v[-1]) - n_nextn, n_nextn


class _Receiver:
    """Writes one peer's chunks into the part file, verifying each tensor as it completes."""

    def __init__(self, fd: int, lay, wanted: set[str], bar) -> None:
        self.fd, self.lay, self.wanted, self.bar = fd, lay, wanted, bar
        self.by_name = {t.name: t for t in lay.tensors}
        self.done: set[str] = set()
        self.moved = 0
        self._name, self._next, self._hash = None, 0, None

    def take(self, peer: str, c: pb.TensorChunk) -> None:
        t = self.by_name.get(c.name)
        if t is None or c.name not in self.wanted or c.name in self.done:
            raise FetchError(f"peer {peer} sent tensor {c.name!r}, which was not asked for")
        if c.name != self._name:
            if self._name is not None:
                raise FetchError(f"peer {peer} sent tensor {self._name!r} short: {self._next} of "
                                 f"{self.by_name[self._name].n_bytes} bytes")
            self._name, self._next, self._hash = c.name, 0, hashlib.sha256()
        if c.total_bytes != t.n_bytes or c.offset != self._next or c.offset + len(c.data) > t.n_bytes:
            raise FetchError(f"peer {peer} sent bytes {c.offset}..{c.offset + len(c.data)} of tensor {c.name!r} "
                             f"(total {c.total_bytes}); expected offset {self._next} of {t.n_bytes}")
        os.pwrite(self.fd, c.data, self.lay.offsets[c.name] + c.offset)
        self._hash.update(c.data)
        self._next += len(c.data)
        self.moved += len(c.data)
        self.bar.update(len(c.data))
        if self._next == t.n_bytes:
            got = self._hash.hexdigest()
            self._name = None
            if got != t.sha256:
                raise FetchError(f"peer {peer} sent tensor {c.name!r} whose bytes hash to {got[:16]}..., but "
                                 f"the manifest says {t.sha256[:16]}...: refused")
            self.done.add(c.name)

    def finish(self, peer: str) -> None:
        if self._name is not None:
            raise FetchError(f"peer {peer} stopped in tensor {self._name!r} after {self._next} bytes")


def fetch_range(manifest: ModelManifest, layers: LayerRange, models_dir: str | os.PathLike,
                peers: Sequence[tuple[str, str]], open_channel: Callable[[str], grpc.Channel],
                progress: bool | None = None) -> FetchResult:
    """Build (or resume, or find complete) the range-only file of ``layers`` in ``models_dir``.

    Args:
        peers: ``(node_id, address)`` of nodes serving the model, tried in order; each is asked for
            the tensors still missing. A peer at its limit of concurrent fetches (RESOURCE_EXHAUSTED) is
            asked again after the others, every :data:`BUSY_RETRY_S` for up to :data:`BUSY_WAIT_S`.
        open_channel: a gRPC channel to an address (join token and TLS as the mesh requires).
        progress: a tqdm bar of bytes on stderr (default: when stderr is a terminal; log lines otherwise).
    Raises:
        ValueError: layers outside the model, or ``models_dir`` not a folder that can be written.
        FetchError: tensors still missing after every peer was tried; names each peer's failure.
    """
    n_layer, n_nextn = n_layer_of(manifest)
    if not (0 <= layers.start < layers.end <= n_layer):
        raise ValueError(f"layers {layers} are outside the model's [0, {n_layer})")
    lay = layout(manifest, range_tensor_names(manifest.tensors, layers, n_layer, n_nextn))
    total = sum(t.n_bytes for t in lay.tensors)
    final = Path(models_dir) / range_file_name(manifest, layers.start, layers.end)
    part = final.with_name(final.name + ".part")
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file where the folder should be, no permission
        raise ValueError(f"cannot keep range files in {final.parent}: {e.strerror or e}") from None
    if final.exists():
        try:
            if model_manifest(final).id == manifest.id:
                return FetchResult(final, manifest.id, 0, total)
        except GGUFError as e:
            log.warning("%s does not verify (%s): fetching what is wrong again", final, e)
        os.replace(final, part)
    fd, done = open_part(part, lay)
    try:
        missing = [t.name for t in lay.tensors if t.name not in done]
        held = total - sum(t.n_bytes for t in lay.tensors if t.name in set(missing))
        if done:
            log.info("resuming %s: %d of %d tensors already verified", part.name, len(done), len(lay.tensors))
        show = sys.stderr.isatty() if progress is None else progress
        bar = tqdm(total=total, initial=held, unit="B", unit_scale=True, desc=f"fetch layers {layers}",
                   disable=not show, file=sys.stderr)
        moved, failures, queue = 0, [], list(peers)
        busy_until = time.monotonic() + BUSY_WAIT_S
        while queue and missing:
            node_id, address = queue.pop(0)
            rx = _Receiver(fd, lay, set(missing), bar)
            channel = open_channel(address)
            call = pb_grpc.NodeStub(channel).FetchTensors(pb.TensorRequest(model_id=manifest.id, names=missing))
            try:
                for chunk in call:
                    rx.take(node_id, chunk)
                rx.finish(node_id)
            except FetchError as e:
                failures.append(str(e))
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < busy_until:
                    queue.append((node_id, address))
                    time.sleep(BUSY_RETRY_S)
                else:
                    failures.append(f"peer {node_id} ({address}): {e.code().name}: {e.details()}")
            finally:
                call.cancel()
                channel.close()
            moved += rx.moved
            missing = [n for n in missing if n not in rx.done]
            log.info("fetched %d of %d tensor bytes from %s (%d tensors left)", moved, total, node_id, len(missing))
        bar.close()
        if missing:
            why = "; ".join(failures) or "no peer serving the model holds them"
            raise FetchError(f"{len(missing)} tensors of layers {layers} are still missing, e.g. {missing[0]!r}: "
                             f"{why}")
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(part, final)
    return FetchResult(final, manifest.id, moved, total)


def fetch_from_tracker(tracker: pb_grpc.TrackerStub, model: str, layers: LayerRange, models_dir: str | os.PathLike,
                       open_channel: Callable[[str], grpc.Channel], progress: bool | None = None) -> FetchResult:
    """:func:`fetch_range` with the manifest and the peers from the tracker: the nodes registered for the
    model that accept connections, those serving more of ``layers`` first.

    Raises:
        FetchError: the tracker has no manifest for ``model`` (or it does not verify), or as fetch_range.
    """
    from meshnet.model.bundled import tracker_name

    try:
        reply = tracker.GetManifest(pb.ManifestRequest(model=tracker_name(model)), timeout=30)
        manifest = ModelManifest.from_compressed(reply.manifest, expect_id=reply.model_id)
        nodes = tracker.ListNodes(pb.Empty(), timeout=10).nodes
    except grpc.RpcError as e:
        raise FetchError(f"the tracker has no manifest for {model!r}: {e.code().name}: {e.details()}") from None
    except GGUFError as e:
        raise FetchError(f"the tracker's manifest for {model!r} does not verify: {e}") from None

    def overlap(n: pb.NodeStatus) -> int:
        r = n.info.layers
        return max(0, min(r.end, layers.end) - max(r.start, layers.start))

    serving = sorted((n for n in nodes if n.info.model.sha256 == manifest.id and not n.info.relayed),
                     key=overlap, reverse=True)
    return fetch_range(manifest, layers, models_dir, [(n.info.node_id, n.info.address) for n in serving],
                       open_channel, progress)
