"""The tracker's side of membership: which signed messages to believe.

Rules (each refusal is an :class:`AuthError` whose message the tracker returns as UNAUTHENTICATED):

* A signed message must verify (:func:`~meshnet.membership.identity.verify_message`): good Ed25519
  signature, timestamp within ``max_skew_s`` (60 s) of the tracker's clock.
* Its public key must match the claimed node id: either the id *is* the key's id
  (:func:`~meshnet.membership.identity.node_id_for`), or the id was bound to this key when it first
  registered (readable ids chosen with ``--node-id``). An id shaped like a key's id (32 lowercase hex
  digits) is never bound to another key, so nobody can squat a node's id before it first registers. Bindings are kept by a :class:`KeyBindings` store
  (the tracker's ledger database), so they survive a tracker restart.
* The same signature is accepted once: a captured message replayed within the timestamp window is
  refused too.
* An unsigned message (older nodes, hand-written tests) is accepted only for an id no key is bound to,
  and only while ``require_signatures`` is off: once a node has proved a key, nobody can heartbeat or
  deregister it without that key.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Protocol

from meshnet.membership.identity import SignatureError, is_signed, node_id_for, verify_message


def _looks_derived(node_id: str) -> bool:
    """True for ids of the form :func:`node_id_for` produces (32 lowercase hex digits)."""
    return len(node_id) == 32 and all(c in "0123456789abcdef" for c in node_id)


class AuthError(Exception):
    """A message the tracker must refuse; ``message`` names the node and the reason."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class KeyBindings(Protocol):
    """Where node-id -> public-key bindings live (the ledger implements it over its database)."""

    def node_key(self, node_id: str) -> bytes | None:
        """The key bound to ``node_id``, or None."""

    def bind_node_key(self, node_id: str, public_key: bytes) -> bytes:
        """Bind ``node_id`` to ``public_key`` unless it is bound already; return the bound key."""


class MemoryBindings:
    """:class:`KeyBindings` in a dict (tests, and trackers without a database)."""

    def __init__(self) -> None:
        self._keys: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def node_key(self, node_id: str) -> bytes | None:
        with self._lock:
            return self._keys.get(node_id)

    def bind_node_key(self, node_id: str, public_key: bytes) -> bytes:
        with self._lock:
            return self._keys.setdefault(node_id, bytes(public_key))


class Authenticator:
    """Decides whether a node's message is really from that node (thread-safe).

    Args:
        bindings: node-id -> key store.
        require_signatures: refuse unsigned messages even for ids no key is bound to.
        max_skew_s: accepted distance, in seconds, between a message's timestamp and ``clock()``.
        clock: Unix seconds (tests pass a fake one).
    """

    def __init__(self, bindings: KeyBindings, require_signatures: bool = False, max_skew_s: float = 60.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.bindings = bindings
        self.require_signatures = require_signatures
        self.max_skew_s = float(max_skew_s)
        self._clock = clock
        self._seen: dict[bytes, float] = {}  # signature -> when it stops being replayable
        self._lock = threading.Lock()

    def check(self, node_id: str, message, bind: bool = False) -> bool:
        """Accept or refuse ``message``, which claims to come from ``node_id``.

        Args:
            node_id: the id the message speaks for.
            message: NodeInfo, HeartbeatRequest, NodeRef or WorkReport.
            bind: a registration: bind ``node_id`` to the message's key if no key is bound yet. Call
                :meth:`bind` after the registration succeeded; ``check`` itself never writes.

        Returns:
            True for a verified signed message, False for an accepted unsigned one.

        Raises:
            AuthError: the message must be refused (the message says why).
        """
        kind = message.DESCRIPTOR.name
        bound = self.bindings.node_key(node_id)
        if not is_signed(message):
            if bound is not None:
                raise AuthError(f"{kind} for node {node_id!r} is unsigned, but that node signs its messages "
                                "with a registered key: refused")
            if self.require_signatures:
                raise AuthError(f"{kind} for node {node_id!r} is unsigned; this tracker accepts only signed "
                                "node messages (upgrade the node)")
            return False
        now = self._clock()
        try:
            key = verify_message(message, now, self.max_skew_s)
        except SignatureError as e:
            raise AuthError(f"node {node_id!r}: {e.message}") from None
        if _looks_derived(node_id) and node_id != node_id_for(key):
            # A key's own id can only ever be claimed by that key, even before it first registers.
            raise AuthError(f"{kind}: node id {node_id!r} is the id of another key (this message's key has id "
                            f"{node_id_for(key)}); refused")
        if bound is not None:
            if bound != key:
                raise AuthError(f"{kind}: node id {node_id!r} belongs to another key (fingerprint "
                                f"{node_id_for(bound)[:12]}, this message's is {node_id_for(key)[:12]}); "
                                "refused: start the node with the --identity key file it first registered with, "
                                "or give it another --node-id")
        elif node_id != node_id_for(key) and not bind:
            raise AuthError(f"{kind}: node id {node_id!r} is neither this key's id ({node_id_for(key)}) nor "
                            "registered with it; register first")
        self._once(bytes(message.signature), now)
        return True

    def bind(self, node_id: str, message) -> None:
        """After a successful signed registration: remember ``node_id``'s key (no-op when unsigned).

        Raises:
            AuthError: another key won a race to bind ``node_id``.
        """
        if not is_signed(message):
            return
        bound = self.bindings.bind_node_key(node_id, bytes(message.public_key))
        if bound != bytes(message.public_key):
            raise AuthError(f"node id {node_id!r} was just bound to another key; refused")

    def is_bound(self, node_id: str) -> bool:
        """True when ``node_id`` has proved a key (it is then listed as signed)."""
        return self.bindings.node_key(node_id) is not None

    def _once(self, signature: bytes, now: float) -> None:
        """Refuse a signature seen before while it could still pass the timestamp check."""
        with self._lock:
            if len(self._seen) > 4096:
                for sig in [s for s, until in self._seen.items() if until < now]:
                    del self._seen[sig]
            until = self._seen.get(signature)
            if until is not None and until >= now:
                raise AuthError("replayed message: this exact signed message was accepted before")
            # A signature stays valid up to max_skew_s after its timestamp, which itself may lie up to
            # max_skew_s ahead of now: remember it for twice the window.
            self._seen[signature] = now + 2 * self.max_skew_s
