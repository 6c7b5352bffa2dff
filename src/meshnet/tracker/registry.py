"""The tracker's membership table: registered nodes, their heartbeats, and route epochs.

A node registers once, then heartbeats every ``heartbeat_interval_s``; a node silent for
``ttl_s = 3 * heartbeat_interval_s`` leaves routing (two lost heartbeats are tolerated, the third is not).
Expired entries are dropped lazily, whenever the table is read. All methods are thread-safe.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from meshnet.tracker.routing import NodeRecord
from meshnet.wire.envelope import PROTOCOL_MAJOR, PROTOCOL_MINOR

# Membership changes, for the operator (``meshnet tracker`` prints this logger's INFO lines).
log = logging.getLogger("meshnet.tracker.members")

# Missed heartbeats after which a node is presumed gone.
TTL_HEARTBEATS = 3
# How long a node a client's route request excluded is taken only where no other chain serves (seconds): a
# node the tracker reaches but clients do not (NAT without --relay, a wrong --advertise) was handed to every
# new client, each of which waited for it before routing around it. A node that registers again (restarted)
# starts afresh.
AVOID_S = 60.0
# Nodes registered at once, at most: every node list and the dashboard's state carry them all, and 20,000
# registrations of long fields made ListNodes larger than gRPC's message limit (nodes fetching tensors from
# peers, `meshnet nodes` and `meshnet up` all failed) and the dashboard's state 59 MB.
MAX_NODES = 4096
# The largest previous_epoch a client may bring that this registry did not hand out itself (one remembered
# across a tracker restart): far above any real count of routes, far enough below 2**64 - 1 that the
# counter, moved up to it, can never overflow the uint64 field routes carry it in.
MAX_CLIENT_EPOCH = 1 << 62


class RegistryFull(Exception):
    """The registry holds :data:`MAX_NODES` live nodes: a new node id is refused (RESOURCE_EXHAUSTED)."""


class ProtocolMismatch(ValueError):
    """A node speaks a protocol major version other than the tracker's; the message names both."""


class NodeIdInUse(ValueError):
    """A registration claims the id of a live node at another address; the message names the id, the live
    address and when that entry expires if its node is gone.

    Attributes:
        node_id: the id claimed.
        live_address: the address the live entry was registered with.
        expires_in_s: seconds until that entry expires unless its node is heard from again.
    """

    def __init__(self, message: str, node_id: str, live_address: str, expires_in_s: float = 0.0):
        super().__init__(message)
        self.expires_in_s = expires_in_s
        self.node_id = node_id
        self.live_address = live_address


@dataclass(frozen=True)
class RegisteredNode:
    """One row of :meth:`Registry.statuses`.

    Attributes:
        record: what routing knows about the node (sessions and speed from its last heartbeat).
        last_heartbeat_age_s: seconds since the node registered or last heartbeated.
        protocol_major, protocol_minor: the version the node registered with.
        free_memory_bytes: what the node reported at registration (0 = not reported).
        device: the device the node computes on as it registered it (``{"name", "description",
            "type", "memory_total_bytes", "index", "cpu_features"}``, memory in bytes); None when it registered none.
        version: the node's meshnet release as it registered it ("" = not said: an older node).
    """

    record: NodeRecord
    last_heartbeat_age_s: float
    protocol_major: int
    protocol_minor: int
    free_memory_bytes: int = 0
    device: dict | None = None
    version: str = ""


@dataclass
class _Entry:
    record: NodeRecord
    last_seen: float
    protocol_major: int
    protocol_minor: int
    free_memory_bytes: int
    device: dict | None = None
    version: str = ""
    granted: int = 0  # routes through it handed out since its last heartbeat
    excluded_at: float = float("-inf")  # when a client's route request last excluded it (clock seconds)


class Registry:
    """Registered nodes with heartbeat expiry, and the route-epoch counter.

    Args:
        heartbeat_interval_s: how often nodes are asked to heartbeat, in seconds (> 0).
        clock: monotonic seconds; tests pass a fake one.

    Raises:
        ValueError: ``heartbeat_interval_s`` is not a positive finite number.
    """

    def __init__(self, heartbeat_interval_s: float = 2.0, clock: Callable[[], float] = time.monotonic,
                 max_nodes: int = MAX_NODES):
        if not (heartbeat_interval_s > 0 and math.isfinite(heartbeat_interval_s)):
            raise ValueError(f"heartbeat interval must be a positive number of seconds, got {heartbeat_interval_s}")
        self.max_nodes = max_nodes
        self.heartbeat_interval_s = float(heartbeat_interval_s)
        self.ttl_s = TTL_HEARTBEATS * self.heartbeat_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._epoch = 0

    # ---- membership ----------------------------------------------------------------------------------

    def register(self, record: NodeRecord, protocol_major: int, protocol_minor: int,
                 free_memory_bytes: int = 0, device: dict | None = None, version: str = "") -> None:
        """Add ``record``, replacing an entry with the same node id that has expired or has the same address
        (the node re-registering, or restarted on its port: it leaves no ghost).

        Raises:
            NodeIdInUse: a live entry (heard from within ``ttl_s``) has this node id and another address:
                a second process claiming a running node's id would otherwise take over its routes while
                the first keeps heartbeating for it.
            ProtocolMismatch: ``protocol_major`` differs from this tracker's ``PROTOCOL_MAJOR``
                (minor versions may differ: they only add fields older readers ignore).
            RegistryFull: a new node id while ``max_nodes`` live nodes are registered.
            ValueError: empty node id, address or model sha256, or a layer range outside ``[0, n_layer)``.
        """
        with self._lock:
            now = self._admit(record, protocol_major, protocol_minor)
            old = self._entries.get(record.node_id)
            self._entries[record.node_id] = _Entry(record, now, protocol_major, protocol_minor,
                                                   max(int(free_memory_bytes), 0), device, version)
        if old is not None and now - old.last_seen >= self.ttl_s:
            _expired(record.node_id, now - old.last_seen)  # silent (stopped, cut off), and back before a sweep
            old = None
        if old is None or old.record.address != record.address or old.record.layers != record.layers:
            log.info("node %s joined: layers [%d, %d) at %s%s", record.node_id, record.layers.start,
                     record.layers.end, record.address, " (relayed)" if record.relayed else "")
        elif old.record.instance and record.instance and old.record.instance != record.instance:
            # Killed and restarted within its TTL at the same address: without this, nothing said so.
            log.info("node %s restarted: a new process at %s", record.node_id, record.address)

    def check_admissible(self, record: NodeRecord, protocol_major: int, protocol_minor: int) -> None:
        """Raise what :meth:`register` would for ``record``, registering nothing."""
        with self._lock:
            self._admit(record, protocol_major, protocol_minor)

    def _admit(self, record: NodeRecord, protocol_major: int, protocol_minor: int) -> float:
        """:meth:`register`'s checks (lock held); returns the clock's time."""
        if protocol_major != PROTOCOL_MAJOR:
            newer = "newer" if protocol_major > PROTOCOL_MAJOR else "older"
            raise ProtocolMismatch(
                f"node {record.node_id!r} speaks protocol {protocol_major}.{protocol_minor}, {newer} than "
                f"the tracker's {PROTOCOL_MAJOR}.{PROTOCOL_MINOR}; run the same major version on both")
        problem = validate_record(record)
        if problem:
            raise ValueError(problem)
        now = self._clock()
        # Routing takes a model's layer count as the largest its nodes claim: one node saying the model
        # has more layers would leave every other node of it out of every route.
        for other in self._entries.values():
            o = other.record
            if (o.node_id != record.node_id and o.model_sha256 == record.model_sha256
                    and now - other.last_seen < self.ttl_s
                    and (o.n_layer, o.architecture) != (record.n_layer, record.architecture)):
                raise ValueError(
                    f"node {record.node_id[:40]!r} says model {record.model_sha256[:12]} is {record.architecture!r} "
                    f"with {record.n_layer} layers, but node {o.node_id[:40]!r} serving it says {o.architecture!r} "
                    f"with {o.n_layer}: one model id is one model")
        live = self._entries.get(record.node_id)
        if live is None and len(self._entries) >= self.max_nodes:
            now = self._sweep()
            if len(self._entries) >= self.max_nodes:
                raise RegistryFull(f"the tracker holds {len(self._entries)} nodes, its limit: node "
                                   f"{record.node_id!r} is refused until one leaves")
        if live is not None and now - live.last_seen < self.ttl_s and live.record.address != record.address:
            age = now - live.last_seen
            raise NodeIdInUse(
                f"node id {record.node_id!r} is in use by a live node at {live.record.address} (last heard "
                f"{age:.1f} s ago); start this one with another --node-id, or without one for a fresh id "
                f"(if that node has just died, its entry expires in {self.ttl_s - age:.1f} s)",
                record.node_id, live.record.address, self.ttl_s - age)
        return now

    def heartbeat(self, node_id: str, active_sessions: int, decode_tokens_per_s: float) -> bool:
        """Record that ``node_id`` is alive, with its current load and (if > 0) a fresh speed.

        Returns:
            False when the node is unknown or has already expired: it must register again.
        """
        with self._lock:
            now = self._clock()
            entry = self._entries.get(node_id)
            if entry is None:
                return False
            if now - entry.last_seen >= self.ttl_s:
                # Expired but not yet swept: it already left routing, so it must register again.
                del self._entries[node_id]
                _expired(node_id, now - entry.last_seen)
                return False
            changes: dict = {"active_sessions": max(int(active_sessions), 0)}
            entry.granted = 0  # the sessions they opened are in its count now
            # 0 means "no new measurement": keep the last known speed.
            if decode_tokens_per_s > 0 and math.isfinite(decode_tokens_per_s):
                changes["decode_tokens_per_s"] = float(decode_tokens_per_s)
            entry.record = dataclasses.replace(entry.record, **changes)
            entry.last_seen = now
            return True

    def deregister(self, node_id: str) -> bool:
        """Remove ``node_id``. Returns False when it was not registered (deregistering is idempotent)."""
        with self._lock:
            gone = self._entries.pop(node_id, None) is not None
        if gone:
            log.info("node %s left", node_id)
        return gone

    def get(self, node_id: str) -> NodeRecord | None:
        """The record of ``node_id`` if it is registered and not expired, else None."""
        with self._lock:
            entry = self._entries.get(node_id)
            if entry is None or self._clock() - entry.last_seen >= self.ttl_s:
                return None
            return entry.record

    def alive(self) -> list[NodeRecord]:
        """Records of the nodes heard from within ``ttl_s``, sorted by node id; expired ones are dropped."""
        with self._lock:
            self._sweep()
            return [self._entries[k].record for k in sorted(self._entries)]

    def routable(self) -> list[NodeRecord]:
        """:meth:`alive`, each node's sessions counting the routes through it handed out since its last
        heartbeat: requests that arrive together saw the same count, and the same cheapest replica, and all
        went to it, its twin idle, until heartbeats told otherwise."""
        with self._lock:
            self._sweep()
            entries = [self._entries[k] for k in sorted(self._entries)]
            return [dataclasses.replace(e.record, active_sessions=e.record.active_sessions + e.granted)
                    if e.granted else e.record for e in entries]

    def granted(self, node_ids: Iterable[str]) -> None:
        """A route through ``node_ids`` was handed out: each counts a session more until it heartbeats."""
        with self._lock:
            for node_id in node_ids:
                entry = self._entries.get(node_id)
                if entry is not None:
                    entry.granted += 1

    def avoided(self, excluded: Iterable[str] = ()) -> set[str]:
        """The nodes a client's route request excluded within the last :data:`AVOID_S` seconds, this one's
        ``excluded`` included (its client found them down, or could not reach them): routes take them only
        where no other chain serves."""
        with self._lock:
            now = self._clock()
            for node_id in excluded:
                entry = self._entries.get(node_id)
                if entry is not None:
                    entry.excluded_at = now
            return {k for k, e in self._entries.items() if now - e.excluded_at < AVOID_S}

    def statuses(self) -> list[RegisteredNode]:
        """Every live node with the age of its last heartbeat (seconds), sorted by node id."""
        with self._lock:
            now = self._sweep()
            return [RegisteredNode(e.record, max(now - e.last_seen, 0.0), e.protocol_major, e.protocol_minor,
                                   e.free_memory_bytes, e.device, e.version)
                    for e in (self._entries[k] for k in sorted(self._entries))]

    def _sweep(self) -> float:
        """Drop expired entries (lock held); returns the time used."""
        now = self._clock()
        for node_id in [k for k, e in self._entries.items() if now - e.last_seen >= self.ttl_s]:
            _expired(node_id, now - self._entries.pop(node_id).last_seen)
        return now

    # ---- route epochs --------------------------------------------------------------------------------

    def next_epoch(self, previous: int = 0) -> int:
        """A route epoch greater than ``previous`` and than every epoch this registry handed out before.

        Taking ``previous`` into account keeps epochs increasing for a client even across a tracker
        restart (the counter starts again at 0, the client remembers its last epoch).

        Raises:
            ValueError: ``previous`` is above :data:`MAX_CLIENT_EPOCH` and above every epoch handed out:
                no tracker issued it, and taking it would move the shared counter to the top of the
                uint64 range, after which no route could be numbered.
        """
        with self._lock:
            self._check_previous(previous)
            self._epoch = max(self._epoch, int(previous)) + 1
            return self._epoch

    def check_previous_epoch(self, previous: int) -> None:
        """Raise what :meth:`next_epoch` would for ``previous``, handing out nothing."""
        with self._lock:
            self._check_previous(previous)

    def _check_previous(self, previous: int) -> None:
        if int(previous) > max(self._epoch, MAX_CLIENT_EPOCH):
            raise ValueError(f"previous_epoch {previous} was never handed out (this tracker's epochs are at "
                             f"{self._epoch}; a client's remembered epoch is taken up to {MAX_CLIENT_EPOCH})")


def _expired(node_id: str, silent_s: float) -> None:
    log.info("node %s left routing: silent for %.1f s (no heartbeat)", node_id, silent_s)


def validate_record(record: NodeRecord) -> str | None:
    """None when ``record`` can be registered, else a message naming the bad field."""
    if not record.node_id.strip():
        return "node id is empty"
    if not record.address.strip():
        return f"node {record.node_id!r}: address is empty (expected host:port)"
    if not record.model_sha256.strip():
        return f"node {record.node_id!r}: model sha256 is empty"
    if record.n_layer <= 0:
        return f"node {record.node_id!r}: model has n_layer={record.n_layer}; expected at least 1"
    if record.layers.end > record.n_layer:
        return (f"node {record.node_id!r}: layer range [{record.layers.start}, {record.layers.end}) "
                f"exceeds the model's {record.n_layer} layers")
    if not (record.decode_tokens_per_s >= 0 and math.isfinite(record.decode_tokens_per_s)):
        return f"node {record.node_id!r}: decode_tokens_per_s must be a finite number >= 0, " \
               f"got {record.decode_tokens_per_s}"
    return None
