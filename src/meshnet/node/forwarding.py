"""Node-to-node forwarding: a stage sends its output straight to the next stage of the route.

With client-orchestrated steps a token crosses 2S links for S stages (client -> hop -> client, per hop).
A forwarded step crosses S + 1: the client sends token ids to the head with the rest of the route
(``Envelope.next_hops``), each stage runs its layers and sends its hidden states on to the next one
(one-way FORWARD messages on that node's data plane), and the tail hands its sampled token to the
client, which asked for it with an AWAIT on the tail's data plane when it sent the step.

Failures travel the same way: a stage that refuses a forwarded step, or cannot reach the next one,
sends a ``HopFailure`` to the tail, which answers the client's await with it, so the client learns which
node failed without hearing from every hop. (A tail that is down answers nothing: the client's await
breaks or times out, and it probes the route's nodes.)

Every node applies the same rules to a forwarded step as to a client's: the join token authenticates
the connection, frames are validated before the engine sees them, epochs fence old steps. Under TLS a
node dials the next one over TLS and verifies its certificate with the CA it verifies the tracker with.
A node sends on only to the data addresses of the nodes registered with its tracker
(:mod:`meshnet.node.registered_peers`): a step names its next hops itself.
"""

from __future__ import annotations

import collections
import logging
import ssl
import threading
import time
from typing import Callable

from meshnet.node.registered_peers import NeedsRefresh, RegisteredPeers
from meshnet.proto import meshnet_pb2 as pb
from meshnet.wire.data_plane import FORWARD, STALL_S, ConnectionPool, DataPlaneError
from meshnet.wire.addresses import check_address

# How long the tail keeps an outcome nobody has asked for yet (its client's await is late or gone), and
# how long an await waits for a step that never arrives (its client has given up long before), seconds.
OUTCOME_TTL_S = 120.0
# Outcomes and awaits held at most: a client that sends steps and never awaits them cannot grow a node.
MAX_PENDING = 4096

# Hops a forwarded step may still have to go through: a route has one hop per layer range at most.
MAX_NEXT_HOPS = 512
# After connecting to a next node, or its handshake, failed after a second or more, sends to it fail at
# once for this long, seconds: each would hold a step thread up to the timeout, and 24
# steps naming an address that never answers kept every thread of a node busy.
UNREACHABLE_S = 5.0
# Next nodes a node keeps connection pools (and unreachable marks) for: past it, the least recently used
# is closed (an address named once, by a client that made it up, is not kept for good).
MAX_PEERS = 256
# A next node that cannot be reached is logged at most this often, seconds (each step naming it fails).
UNREACHABLE_WARN_S = 60.0

log = logging.getLogger("meshnet.node")

AwaitKey = tuple[str, int, int]  # (session_id, step_id, epoch)


def next_hops_error(hops, own_node_id: str, layers_after: int = MAX_NEXT_HOPS) -> str | None:
    """Why ``hops`` (the ``ForwardHop`` s a step names after this node) is no route, or None.

    A route names each node once and never the node it is at: a list that loops back (through this node,
    or twice through another) would make one request run and forward steps without end. Each later hop
    serves a layer at least, so there are at most ``layers_after`` of them (the model's layers after this
    node's range): a node reached under 511 spellings of its own address (``LOCALHOST``, ``localHost``...)
    ran one step 512 times. Addresses are compared without case, as DNS names are.
    """
    most = min(layers_after, MAX_NEXT_HOPS)
    if len(hops) > most:
        return (f"next_hops names {len(hops)} hops, but {most} at most can follow this node "
                f"({layers_after} layers come after its range)")
    ids, addresses = set(), set()
    for i, hop in enumerate(hops):
        if hop.node_id == own_node_id:
            return f"next_hops[{i}] is this node ({own_node_id}): a route never comes back to a node"
        address = hop.data_address.lower()
        if hop.node_id in ids or address in addresses:
            return f"next_hops[{i}] ({hop.node_id} at {hop.data_address}) is named twice in the route"
        try:
            check_address(hop.data_address)
        except ValueError as e:
            return f"next_hops[{i}] ({hop.node_id}): {e}"
        ids.add(hop.node_id)
        addresses.add(address)
    return None


def await_key(envelope: pb.Envelope | pb.AwaitStep) -> AwaitKey:
    return envelope.session_id, int(envelope.step_id), int(envelope.epoch)


class AwaitedOutcomes:
    """The tail's outcomes of forwarded steps, each handed to the client that awaits it.

    The forwarded step and the client's AwaitStep reach the tail by different paths, so either may come
    first: an outcome waits for its await, an await for its outcome. ``answer`` callbacks run on the
    thread that completes the pair. Entries older than ``ttl_s`` seconds are dropped (an expired await
    is answered DEADLINE_EXCEEDED, as is one superseded by a second await of the same step, each saying
    which), and beyond ``max_entries`` the oldest goes first. Expiry runs with each delivery and await,
    and from :meth:`sweep`, which the node calls every few seconds: an await on a node nothing else
    reaches was otherwise kept until its client's connection closed.
    """

    def __init__(self, make_outcome: Callable[..., object], ttl_s: float = OUTCOME_TTL_S,
                 max_entries: int = MAX_PENDING) -> None:
        self._make_outcome = make_outcome  # make_outcome(code, message) -> StepOutcome
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self._outcomes: collections.OrderedDict[AwaitKey, tuple[float, object]] = collections.OrderedDict()
        self._waiters: collections.OrderedDict[AwaitKey, tuple[float, Callable]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def deliver(self, key: AwaitKey, outcome) -> None:
        """The step ``key`` finished at this tail (or failed before it) with ``outcome`` (a StepOutcome)."""
        with self._lock:
            expired = self._expire()
            waiter = self._waiters.pop(key, None)
            if waiter is None:
                self._outcomes[key] = (time.monotonic(), outcome)
                expired += self._trim()
        self._refuse(expired)
        if waiter is not None:
            waiter[1](outcome)

    def await_(self, key: AwaitKey, answer: Callable) -> Callable[[], None]:
        """Call ``answer(outcome)`` once step ``key``'s outcome is here (now, if it already is).

        Returns a function that withdraws the await (its client hung up): ``answer`` is then never
        called, and an outcome arriving later is kept like one nobody has awaited yet."""
        with self._lock:
            expired = self._expire()
            done = self._outcomes.pop(key, None)
            if done is None:
                old = self._waiters.pop(key, None)
                if old is not None:  # the client asked again (a new connection): the old one is gone
                    expired.append((old[1], "the await was superseded by another await of the same step"))
                self._waiters[key] = (time.monotonic(), answer)
                expired += self._trim()
        self._refuse(expired)
        if done is not None:
            answer(done[1])
        return lambda: self._withdraw(key, answer)

    def _withdraw(self, key: AwaitKey, answer: Callable) -> None:
        with self._lock:
            waiter = self._waiters.get(key)
            if waiter is not None and waiter[1] is answer:
                del self._waiters[key]

    def sweep(self) -> None:
        """Drop what is older than ``ttl_s``, answering expired awaits (any thread)."""
        with self._lock:
            expired = self._expire()
        self._refuse(expired)

    @property
    def pending(self) -> tuple[int, int]:
        """(outcomes nobody has awaited yet, awaits still waiting)."""
        with self._lock:
            return len(self._outcomes), len(self._waiters)

    def _expire(self) -> list[tuple[Callable, str]]:
        cutoff = time.monotonic() - self.ttl_s
        while self._outcomes and next(iter(self._outcomes.values()))[0] < cutoff:
            self._outcomes.popitem(last=False)
        answers = []
        while self._waiters and next(iter(self._waiters.values()))[0] < cutoff:
            answers.append((self._waiters.popitem(last=False)[1][1],
                            f"no outcome of the awaited step reached this node within {self.ttl_s:g} s"))
        return answers

    def _trim(self) -> list[tuple[Callable, str]]:
        answers = []
        while len(self._outcomes) + len(self._waiters) > self.max_entries:
            older = self._outcomes if (self._outcomes and (not self._waiters or next(iter(
                self._outcomes.values()))[0] <= next(iter(self._waiters.values()))[0])) else self._waiters
            _, (_, item) = older.popitem(last=False)
            if older is self._waiters:
                answers.append((item, f"the await was dropped: this node keeps at most {self.max_entries} "
                                      "awaits and unawaited outcomes, and it was the oldest"))
        return answers

    def _refuse(self, answers: list[tuple[Callable, str]]) -> None:
        for answer, why in answers:
            answer(self._make_outcome("DEADLINE_EXCEEDED", why))


class WouldWait(Exception):
    """Sending on would wait: for a new connection, or for a pooled one whose peer has not taken what was
    sent before (see Forwarder.send); nothing was sent."""


class Forwarder:
    """Sends forwarded steps (FORWARD frames) to other nodes' data planes over pooled connections.

    Args:
        join_token: this node's join token (the next node checks it like a client's).
        timeout_s: how long connecting to and sending to a node may take, seconds.
        tls: a client context verifying the next nodes' certificates (a mesh under TLS), or None.
    """

    def __init__(self, join_token: str | None, timeout_s: float = 10.0, tls: ssl.SSLContext | None = None) -> None:
        self.join_token, self.timeout_s, self.tls = join_token, timeout_s, tls
        # The nodes registered with this node's tracker, the only ones it sends to (None: any address).
        self.peers: RegisteredPeers | None = None
        self._pools: collections.OrderedDict[str, ConnectionPool] = collections.OrderedDict()
        self._unreachable: dict[str, float] = {}  # address -> monotonic time until which sends fail at once
        self._warned: dict[str, float] = {}  # address -> monotonic time until which its failures are not logged
        # (node id, address) -> monotonic time of the last send to it that failed: by address too, since the
        # id a step names at an address is its sender's word (one naming a node at a dead address marks that)
        self._failed: dict[tuple[str, str], float] = {}
        self._node_ids: dict[str, str] = {}  # address -> the node id last sent to there
        # id(connection) -> (node id, address, monotonic time the send began), while a send lasts (sends to
        # one node from several threads each have their own connection)
        self._sending: dict[int, tuple[str, str, float]] = {}
        self._lock = threading.Lock()

    def send(self, hop: pb.ForwardHop, frames: list[pb.Envelope], connect: bool = True) -> pb.HopFailure | None:
        """Send ``frames`` to ``hop``; None when sent, else the failure naming ``hop`` (UNAVAILABLE).

        A pooled connection the node closed meanwhile is replaced once (its idle timeout, a restart).
        ``connect`` False: raises :class:`WouldWait`, having sent nothing, where that would take a new
        connection (up to ``timeout_s`` to a node that accepts and then hangs), or where the pooled one holds
        half its send buffer unacknowledged (a send could block up to ``timeout_s`` on a peer, or a link,
        that stopped taking bytes: on the engine worker channel's reading thread that held up the answers
        to the supervisor's pings, and the healthy engine worker was killed as hung). A node whose connection
        or handshake failed after a second or more fails at once for :data:`UNREACHABLE_S` after, unless
        a pooled connection to it is idle (a refusal answered at once is not marked: it costs no wait, and
        a node restarting on its port, or at its connection cap a moment, is back at once)."""
        address = hop.data_address
        if self.peers is not None:
            try:
                if not self.peers.admits(address, may_block=connect):  # a link it will not use: see the module
                    # Said in Health too: the failure note goes to the tail, which may be refused alike (a
                    # node restarted during a tracker outage has no list), and a client waiting on the
                    # step then learns it only from its probes.
                    self._failed_to(hop.node_id, address)
                    self._warn_once(address, "this node does not send steps to %s (next node %s): its tracker "
                                    "has not listed that address as a registered node's (or cannot be asked "
                                    "now); clients step that link themselves meanwhile", address, hop.node_id)
                    return pb.HopFailure(node_id=hop.node_id, code="UNAVAILABLE", retry_after_s=-1.0, unreachable=True,
                                         message=f"the hop before it sends steps to the nodes registered with "
                                                 f"its tracker only, and none has the data address {address}")
            except NeedsRefresh:
                raise WouldWait(address) from None
        pool = self._pool(address)
        with self._lock:
            until = self._unreachable.get(address, 0.0)
        if time.monotonic() < until and not pool.idle_count():
            self._failed_to(hop.node_id, address)
            return pb.HopFailure(node_id=hop.node_id, code="UNAVAILABLE", retry_after_s=-1.0, unreachable=True,
                                 message=f"the hop before it could not reach {address} within the last "
                                         f"{UNREACHABLE_S:g} s")
        payloads = [f.SerializeToString() for f in frames]
        error: Exception | None = None
        for _ in range(2):
            started = time.monotonic()
            try:
                conn = pool.acquire(connect=connect)
            except (OSError, DataPlaneError) as e:
                error = e
                # Marked by the time it cost, whatever the error: a timeout, or a host that is gone from its
                # LAN ("no route to host" after seconds of ARP), not a refusal answered at once.
                if time.monotonic() - started >= min(1.0, self.timeout_s / 2):
                    with self._lock:
                        self._unreachable[address] = time.monotonic() + UNREACHABLE_S
                break
            if conn is None:
                raise WouldWait(hop.data_address)
            if not connect and conn.would_wait(sum(len(p) for p in payloads)):
                pool.release(conn)
                raise WouldWait(hop.data_address)
            with self._lock:  # one lock a side of the send: this is every decode hop's path
                self._node_ids[address] = hop.node_id
                self._sending[id(conn)] = (hop.node_id, address, time.monotonic())
            try:
                conn.send(FORWARD, payloads, self.timeout_s)
            except OSError as e:
                with self._lock:
                    self._sending.pop(id(conn), None)
                conn.close()
                error = e
                # Logged though a new connection may yet carry the step: where only open connections go
                # black (a firewall's state dropped), each fails one step after the timeout, and nothing
                # else would say so.
                self._warn_unreachable(hop.node_id, address, f"could not forward to its data plane at {address}: "
                                                             f"sending on an open connection failed ({e})")
                continue
            with self._lock:
                self._sending.pop(id(conn), None)
                self._unreachable.pop(address, None)
                self._failed.pop((hop.node_id, address), None)
                if self._pools.get(address) is pool:
                    pool.release(conn)
                else:  # its pool was dropped meanwhile (see _pool): nobody would use it again
                    conn.close()
            return None
        reason = f"could not forward to its data plane at {address}: {error}"
        self._warn_unreachable(hop.node_id, address, reason, refused=isinstance(error, ConnectionRefusedError))
        self._failed_to(hop.node_id, address)
        return pb.HopFailure(node_id=hop.node_id, code="UNAVAILABLE", retry_after_s=-1.0, unreachable=True,
                             message=f"the hop before it {reason}")

    def unreachable_next(self, within_s: float = UNREACHABLE_WARN_S) -> list[tuple[str, str]]:
        """(node id, data address) of the nodes the last send to failed, within the last ``within_s`` seconds;
        of those a send to has gone on for :data:`STALL_S` or more (blocked: the peer stopped taking bytes);
        and of those whose idle pooled connections still hold bytes sent :data:`STALL_S` ago (a link cut
        under an open connection: the sends succeed into the socket's buffer, and nothing arrives); sorted.
        What Health tells a client waiting on a forwarded step that stopped here. A stalled node is logged
        as a failed one is (:meth:`_warn_unreachable`): no send to it fails while clients step that link."""
        now = time.monotonic()
        with self._lock:
            failed = {k for k, t in self._failed.items() if now - t < within_s}
            stalled = {(n, a) for n, a, t in self._sending.values() if now - t >= STALL_S} - failed
            pools = [((self._node_ids.get(a), a), pool) for a, pool in self._pools.items()]
        stalled.update(k for k, pool in pools if k[0] is not None and k not in failed and k not in stalled
                       and pool.stalled())
        for node_id, address in stalled:  # the failed ones were logged as they failed
            self._warn_unreachable(node_id, address, f"could not forward to its data plane at {address}: what it "
                                   f"sent on an open connection went unacknowledged for {STALL_S:g} s or more")
        return sorted(failed | stalled)

    def _failed_to(self, node_id: str, address: str) -> None:
        with self._lock:
            if len(self._failed) >= MAX_PEERS:
                self._failed.clear()  # ids a client made up: forgetting them costs a client one wait
            self._failed[(node_id, address)] = time.monotonic()

    def _warn_unreachable(self, node_id: str, address: str, reason: str, refused: bool = False) -> None:
        """Log that this node ``reason`` (could not reach ``node_id`` at ``address``), once per
        :data:`UNREACHABLE_WARN_S` an address: the node's own log is where its operator looks for a firewall
        before the next node. ``refused``: nothing listens there (the connection was refused), which is
        most often that node stopped or restarting, not a firewall."""
        why = (" refused the connection: it has stopped or is restarting (clients fail over), or a firewall "
               "rejects this node;" if refused else ";")
        self._warn_once(address, "this node %s (next node %s%s if that node is up, its data port must be open to "
                        "the nodes before it in a route; clients step such a link themselves meanwhile)",
                        reason, node_id, why)

    def _warn_once(self, address: str, fmt: str, *args: object) -> None:
        """Log a warning about ``address``, once per :data:`UNREACHABLE_WARN_S` an address."""
        now = time.monotonic()
        with self._lock:
            if now < self._warned.get(address, 0.0):
                return
            if len(self._warned) >= MAX_PEERS:
                self._warned = {a: until for a, until in self._warned.items() if until > now}
            self._warned[address] = now + UNREACHABLE_WARN_S
        log.warning(fmt, *args)

    def report(self, tail: pb.ForwardHop, step: pb.Envelope, failure: pb.HopFailure, connect: bool = True) -> None:
        """Tell ``tail`` that the step ``step`` heads (its header fields) failed with ``failure``, so it
        answers the client's await; best effort (a tail that cannot be reached answers no await anyway).
        ``connect``: as :meth:`send`."""
        note = pb.Envelope(major=step.major, minor=step.minor, session_id=step.session_id, epoch=step.epoch,
                           position=step.position, step_id=step.step_id, decode=step.decode, n_chunks=1,
                           byte_order="little", failure=failure)
        self.send(tail, [note], connect)

    def _pool(self, address: str) -> ConnectionPool:
        """The pool of connections to ``address``, the most recently used last; past :data:`MAX_PEERS` the
        least recently used pool is closed and dropped, and the unreachable marks that expired too."""
        with self._lock:
            pool = self._pools.get(address)
            if pool is not None:
                self._pools.move_to_end(address)
                return pool
            while len(self._pools) >= MAX_PEERS:
                gone, old = self._pools.popitem(last=False)
                old.close()
                self._node_ids.pop(gone, None)
            if len(self._unreachable) >= MAX_PEERS:  # the marks stay with their pools gone, until they expire
                now = time.monotonic()
                self._unreachable = {a: until for a, until in self._unreachable.items() if until > now}
            pool = self._pools[address] = ConnectionPool(address, self.join_token, self.timeout_s, self.tls)
            return pool

    def close(self) -> None:
        with self._lock:
            for pool in self._pools.values():
                pool.close()
            self._pools.clear()
