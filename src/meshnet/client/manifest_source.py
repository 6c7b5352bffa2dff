"""A client without the model file: its tokenizer and chat template from the tracker's manifest.

The manifest's metadata holds every GGUF key of the model, the tokenizer's and ``tokenizer.chat_template``
included, so a client writes it out as a GGUF without tensors (:func:`meshnet.model.range_file.write_metadata_file`)
and reads it with the same tokenizer and template code as a full file; one representation, no second
tokenizer format.
"""

from __future__ import annotations

import os
from pathlib import Path

import grpc

from meshnet.model.gguf_file import GGUFError
from meshnet.model.manifest import ModelManifest
from meshnet.model.range_file import write_metadata_file
from meshnet.proto import meshnet_pb2 as pb
from meshnet.proto import meshnet_pb2_grpc as pb_grpc
from meshnet.client.router import MeshUnavailable
from meshnet.wire.call_problems import tracker_hint
from meshnet.wire.security import open_channel



def models_dir() -> Path:
    """``<cache>/models`` (the cache as :func:`meshnet.backends.certifications.cache_dir`): where metadata files and
    fetched range-only files go by default."""
    from meshnet.backends.certifications import cache_dir

    return cache_dir() / "models"


def metadata_gguf(tracker: str, model: str, join_token: str | None = None, tls_ca: str | None = None,
                  cache_dir: str | os.PathLike | None = None) -> tuple[Path, str]:
    """``(path of a tensor-less GGUF of the model's metadata, model id)`` for ``model`` (an id, its prefix, a
    ``general.name`` or a bundled name such as ``smollm2``; empty: the tracker's only model), written once
    per id into ``cache_dir`` (default :func:`models_dir`).

    Raises:
        ValueError: the tracker knows no such model (or several by that name), or its manifest does
            not verify against its id.
        MeshUnavailable: the tracker cannot be asked (unreachable, it refuses the join token, the TLS
            settings do not match, the address serves no tracker).
    """
    from meshnet.model.bundled import tracker_name

    stub = pb_grpc.TrackerStub(open_channel(tracker, join_token, tls_ca))
    asked = tracker_name(model)
    try:
        reply = stub.GetManifest(pb.ManifestRequest(model=asked), timeout=30)
        manifest = ModelManifest.from_compressed(reply.manifest, expect_id=reply.model_id)
    except grpc.RpcError as e:
        known_as = f" ({model} is model {asked[:12]})" if asked != model else ""
        message = f"tracker {tracker}: {e.details() or e.code().name}{known_as}{tracker_hint(e, tls_ca)}"
        if e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
            raise ValueError(message) from None  # what was asked for: a usage error
        raise MeshUnavailable(message) from None
    except GGUFError as e:
        raise ValueError(f"tracker {tracker}: the manifest of {model!r} does not verify: {e}") from None
    path = Path(cache_dir or models_dir()) / f"{manifest.id}.meta.gguf"
    if not path.is_file():
        write_metadata_file(manifest, path)
    return path, manifest.id


def model_name_of(path: str | os.PathLike) -> str | None:
    """``general.name`` of the GGUF at ``path`` (None when it has none)."""
    from meshnet.model.gguf_file import open_gguf

    field = open_gguf(str(path)).fields.get("general.name")
    return None if field is None else bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
