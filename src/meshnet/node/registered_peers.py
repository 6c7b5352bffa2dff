"""Which addresses a node forwards steps to: the data planes of the nodes registered with its tracker.

A forwarded step names the next hops itself (``Envelope.next_hops``), so without a check a node dials
whatever address a step names: whoever can send it steps could have it connect to any ``host:port`` it
reaches (a port scan from inside the mesh's network, the reply's timing and words telling open from
closed). Routes only ever name registered nodes, so a node sends on only to the data address of a node
its tracker lists.

The list is the tracker's ``ListNodes``, kept here and asked again when a step names an address it lacks
(a node that joined since), at most once every :data:`REFRESH_S`. When the tracker cannot be asked (an
outage, during which the mesh goes on serving) the addresses last listed are still let through and no
other: routes come from the tracker, so one planned before the outage names listed nodes, and letting every
address through then (as this check once did) turned a stopped tracker into a port scan and a join token
sent to any address a step named. An address refused (a node that joined within the second since the last
asking, or during the outage) is reported to the client as a link this node cannot use, which the client
then steps itself: a route through a new node goes on, one hop slower, rather than fail.

A node restarted during an outage would hold no list at all, and its clients would step every link out of
it themselves for minutes, told to open a data port that is open: a node with a key file (``--node-id`` or
``--identity``, the nodes that come back under the same id) keeps the list beside it, for the same tracker,
and starts from it until the tracker answers.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable, Iterable

import grpc

log = logging.getLogger("meshnet.node")

# The least time between two askings of the tracker's list, seconds: a flood of steps naming made-up
# addresses asks it once a second at most.
REFRESH_S = 1.0
# How long one asking may take, seconds (on a thread that may block: see RegisteredPeers.admits).
LIST_TIMEOUT_S = 2.0
# Addresses read back from a kept list at most (a tracker lists this many nodes at most in practice; a file
# someone else wrote must not become an allocation of its size).
MAX_KEPT = 4096


class NeedsRefresh(Exception):
    """The address is not on the list this node holds, and asking the tracker again may block."""


class RegisteredPeers:
    """The data addresses of the nodes registered with this node's tracker (thread-safe).

    Args:
        list_addresses: returns every registered node's data address (``ListNodes``); raises
            ``grpc.RpcError`` when the tracker cannot be asked.
        clock: monotonic seconds.
        kept: ``(file, tracker)``: the list last answered is kept in ``file`` (JSON, written when it
            changes) and read back at start when it is ``tracker``'s; None: kept in memory only.
    """

    def __init__(self, list_addresses: Callable[[], Iterable[str]],
                 clock: Callable[[], float] = time.monotonic, kept: tuple[Path, str] | None = None) -> None:
        self._list, self._clock, self._kept = list_addresses, clock, kept
        self._known: frozenset[str] = self._read_kept()
        self._asked_at = float("-inf")
        self._reachable = True  # whether the last asking was answered (logged once per outage)
        self._lock = threading.Lock()  # one asking at a time

    def refresh(self) -> None:
        """Ask the tracker's list now, whenever it was last asked (a node that has just registered: a
        tracker that stops before this node's first forwarded step would otherwise leave it no list at all,
        and every link out of it stepped by its clients until the tracker is back). It does not count as
        the last asking: the nodes that register after this one are asked for at the first step naming one."""
        with self._lock:
            self._ask(counts=False)

    def _ask(self, counts: bool = True) -> None:
        """Ask the tracker's list (the lock held); ``counts``: as the last asking (:data:`REFRESH_S`)."""
        if counts:
            self._asked_at = self._clock()
        try:
            known = frozenset(a.lower() for a in self._list() if a)
            self._reachable = True
        except grpc.RpcError as e:
            if self._reachable:
                log.warning("could not ask the tracker which nodes are registered (%s): steps are "
                            "forwarded only to the %d nodes it last listed until it answers",
                            e.code().name, len(self._known))
            self._reachable = False
            return
        if known != self._known:
            self._write_kept(known)
        self._known = known

    def _read_kept(self) -> frozenset[str]:
        """The addresses kept for this tracker by an earlier process of this node; empty when there are none
        (no file, another tracker's, or one that does not read as a list of addresses)."""
        if self._kept is None:
            return frozenset()
        path, tracker = self._kept
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return frozenset()
        addresses = data.get("data_addresses") if isinstance(data, dict) and data.get("tracker") == tracker else None
        if not isinstance(addresses, list) or len(addresses) > MAX_KEPT or \
                not all(isinstance(a, str) and a for a in addresses):
            return frozenset()
        return frozenset(a.lower() for a in addresses)

    def _write_kept(self, known: frozenset[str]) -> None:
        if self._kept is None:
            return
        path, tracker = self._kept
        try:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps({"tracker": tracker, "data_addresses": sorted(known)}))
            os.replace(tmp, path)  # whole or not at all: a node killed while writing keeps the last list
        except OSError as e:
            log.warning("could not keep the list of registered nodes in %s (%s): a restart while the tracker "
                        "is unreachable starts without it", path, os.strerror(e.errno) if e.errno else e)

    def admits(self, address: str, may_block: bool = True) -> bool:
        """Whether a step may be sent on to ``address``: a registered node's data address (as last listed,
        while the tracker cannot be asked). ``may_block`` False raises :class:`NeedsRefresh` where the answer
        takes asking the tracker (the caller asks again from a thread that may wait)."""
        if address.lower() in self._known:
            return True
        if not may_block:  # nor waits for another thread's asking, which holds the lock up to LIST_TIMEOUT_S
            if self._lock.locked() or self._clock() - self._asked_at >= REFRESH_S:
                raise NeedsRefresh(address)
            return address.lower() in self._known  # an asking may have ended since
        with self._lock:
            if self._clock() - self._asked_at >= REFRESH_S:
                self._ask()
            return address.lower() in self._known
