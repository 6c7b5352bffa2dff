"""The manifests a tracker keeps: one per model id, published by the first node that serves the model.

A manifest is kept as the compressed bytes it arrived in (:meth:`meshnet.model.manifest.ModelManifest.compressed`)
after checking that it decodes and hashes to the id it is published under, so nobody can publish
another model's manifest under an id. Clients and fetching nodes look a model up by id or by its
``general.name``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from meshnet.model.gguf_file import GGUFError
from meshnet.model.manifest import ModelManifest

# A tracker serves a handful of models; this bounds what unauthenticated publishers can make it hold.
MAX_MODELS = 64
# The shortest id prefix that names a model (ids are 64 hex digits; tables print the first 12).
MIN_ID_PREFIX = 8


class ManifestRefused(ValueError):
    """A manifest that does not decode, or does not hash to its id (INVALID_ARGUMENT)."""


class ManifestFull(RuntimeError):
    """The store holds :data:`MAX_MODELS` manifests already (RESOURCE_EXHAUSTED)."""


class ManifestNotFound(LookupError):
    """No manifest matches (NOT_FOUND), or a name matches several (``ambiguous``: FAILED_PRECONDITION)."""

    def __init__(self, message: str, ambiguous: bool = False):
        super().__init__(message)
        self.ambiguous = ambiguous


@dataclass(frozen=True)
class _Entry:
    blob: bytes
    name: str


class ManifestStore:
    """Thread-safe id -> manifest map; the first valid copy of an id is kept."""

    def __init__(self) -> None:
        self._by_id: dict[str, _Entry] = {}
        self._lock = threading.Lock()

    def publish(self, model_id: str, blob: bytes) -> bool:
        """Keep ``blob`` (zlib canonical manifest) under ``model_id``; False when one was kept already.

        Raises:
            ManifestRefused: ``blob`` is not a manifest, or hashes to another id.
            ManifestFull: :data:`MAX_MODELS` other models are kept.
        """
        with self._lock:
            if model_id in self._by_id:
                return False
        try:
            m = ModelManifest.from_compressed(blob, expect_id=model_id)
        except GGUFError as e:
            raise ManifestRefused(str(e)) from None
        with self._lock:
            if model_id in self._by_id:
                return False
            if len(self._by_id) >= MAX_MODELS:
                raise ManifestFull(f"the tracker keeps {MAX_MODELS} manifests already")
            self._by_id[model_id] = _Entry(bytes(blob), m.name)
            return True

    def label(self, model_id: str) -> str:
        """``model_id`` as a person names it: its ``general.name`` and first 12 hex digits when a manifest
        of it is kept (both are what ``--model-id`` takes), else the whole id."""
        with self._lock:
            e = self._by_id.get(model_id)
        return f"{e.name} ({model_id[:12]})" if e is not None and e.name else model_id

    def get(self, model: str) -> tuple[str, bytes]:
        """``(id, blob)`` of the model whose id, ``general.name`` (case-insensitive) or id prefix (at least
        MIN_ID_PREFIX hex digits) is ``model``; empty: the only model kept. Raises ManifestNotFound."""
        with self._lock:
            if model in self._by_id:
                return model, self._by_id[model].blob
            if not model:
                if len(self._by_id) == 1:
                    (mid, e), = self._by_id.items()
                    return mid, e.blob
                raise ManifestNotFound(f"{len(self._by_id)} models are known; name one",
                                       ambiguous=bool(self._by_id))
            hits = [(mid, e) for mid, e in self._by_id.items() if e.name and e.name.lower() == model.lower()]
            prefix = model.lower() if all(c in "0123456789abcdef" for c in model.lower()) else None
            if not hits and prefix and len(prefix) >= MIN_ID_PREFIX:
                # The short id `meshnet nodes` and `meshnet ledger` print (12 hex digits), or any unique prefix.
                hits = [(mid, e) for mid, e in self._by_id.items() if mid.startswith(prefix)]
            known = [f"{e.name or '(unnamed)'} ({mid[:12]})" for mid, e in list(self._by_id.items())[:5]]
            short = (not hits and prefix is not None and len(prefix) < MIN_ID_PREFIX
                     and any(mid.startswith(prefix) for mid in self._by_id))
        if not hits:
            why = (f"an id prefix needs at least {MIN_ID_PREFIX} hex digits" if short
                   else "no node serving it has published one")
            raise ManifestNotFound(f"no manifest for model {model!r}: {why}"
                                   + (f"; known: {', '.join(known)}" if known else ""))
        if len(hits) > 1:
            raise ManifestNotFound(f"{len(hits)} models are named (or start with) {model!r}: "
                                   f"{', '.join(mid for mid, _ in hits)}; give an id", ambiguous=True)
        return hits[0][0], hits[0][1].blob
