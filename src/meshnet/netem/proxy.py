"""Forward TCP through emulated links: an asyncio proxy that applies :mod:`meshnet.netem.link`.

Each *listener* stands for one service of one host (say the middle node's gRPC port): it accepts on
the address the others dial and forwards to where the service really listens. The link a connection
crosses is the one between the host it came from (named by its source IP in ``hosts``) and the host the
listener stands for, so the emulator must see the clients' own addresses: on one machine this means
network namespaces (see :mod:`meshnet.netem.namespaces`); on loopback every connection comes from one
address and links are told apart only by their destination.

A connection attempted across a dark link is accepted but not forwarded until the link heals (as a SYN
would be retransmitted); data is held the same way (see the link model). A sender is read from only
while its pipe holds less than :data:`MAX_QUEUED_BYTES`, so a slow or dark link pushes back on it
through TCP's own flow control instead of growing the proxy's memory.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import threading
from concurrent.futures import Future
from dataclasses import asdict, dataclass

from meshnet.netem.link import Link, LinkSpec, Pipe

log = logging.getLogger("meshnet.netem")

READ_BYTES = 64 * 1024
MAX_QUEUED_BYTES = 1024 * 1024


@dataclass(frozen=True)
class Listener:
    """Accept on ``listen`` (host, port) on behalf of host ``owner``; forward to ``target`` (host, port)."""

    owner: str
    listen: tuple[str, int]
    target: tuple[str, int]


class Emulator:
    """The links between named hosts and the listeners that route connections through them. Every
    method runs on the event loop's thread (see :class:`EmulatorThread` for calls from others).

    Args:
        hosts: source IP -> host name; a connection from an unlisted IP counts as from host "IP".
        default: the spec of a link not yet set (default: a plain wire).
    """

    def __init__(self, hosts: dict[str, str], default: LinkSpec = LinkSpec()) -> None:
        self.hosts, self.default = dict(hosts), default
        self._links: dict[frozenset[str], Link] = {}
        self._wake: dict[Pipe, asyncio.Event] = {}
        self._link_changed: dict[Link, asyncio.Event] = {}
        self._servers: list[asyncio.base_events.Server] = []
        self._conns: set[asyncio.Task] = set()
        self._open: dict[Link, set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]]] = {}
        self.accepted = 0

    def link(self, a: str, b: str) -> Link:
        """The link between hosts ``a`` and ``b`` (created with the default spec on first use)."""
        key = frozenset((a, b))
        if key not in self._links:
            self._links[key] = Link(a, b, self.default)
        return self._links[key]

    def set_link(self, a: str, b: str, spec: LinkSpec) -> None:
        """What the link between ``a`` and ``b`` does from now on, both ways, for open connections too."""
        link = self.link(a, b)
        link.update(spec, asyncio.get_running_loop().time())
        for p in link.pipes:
            self._wake[p].set()
        ev = self._link_changed.pop(link, None)
        if ev is not None:
            ev.set()

    def reset(self, a: str, b: str) -> int:
        """Drop every connection open across the link between ``a`` and ``b`` now, as a NAT or a
        firewall that forgets them would: both ends get a TCP reset, and what was in flight is lost.
        Returns how many connections were dropped."""
        pairs = self._open.pop(self.link(a, b), set())
        for pair in pairs:
            for w in pair:
                _reset(w)
        return len(pairs)

    def stats(self) -> dict[str, dict]:
        """Per link "A-B": its spec, open connections and bytes delivered each way over its life
        (``a_to_b``, ``b_to_a``)."""
        return {f"{link.a}-{link.b}": dict(spec=asdict(link.spec), connections=link.open_connections,
                                           a_to_b=link.delivered[0], b_to_a=link.delivered[1])
                for link in self._links.values()}

    async def listen(self, listener: Listener) -> int:
        """Start accepting for ``listener``; returns the port bound (useful with port 0).
        Raises OSError when the address cannot be bound."""
        server = await asyncio.start_server(lambda r, w: self._accept(listener, r, w), *listener.listen)
        self._servers.append(server)
        return server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        for s in self._servers:
            s.close()
        for t in list(self._conns):
            t.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)

    # ---- one connection ------------------------------------------------------------------------
    async def _accept(self, listener: Listener, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._conns.add(task)
        task.add_done_callback(self._conns.discard)
        self.accepted += 1
        await self._serve(listener, reader, writer)

    async def _serve(self, listener: Listener, reader, writer) -> None:
        peer_ip = writer.get_extra_info("peername")[0]
        src = self.hosts.get(peer_ip, peer_ip)
        link = self.link(src, listener.owner)
        up_writer, clean = None, False
        try:
            while link.spec.blackhole:  # the handshake would not get through either
                await self._link_changed.setdefault(link, asyncio.Event()).wait()
            try:
                up_reader, up_writer = await asyncio.open_connection(*listener.target)
            except OSError as e:
                log.info("%s -> %s: %s refused: %s", src, listener.owner, listener.target, e)
                return
            fwd, back = link.pipe(src == link.a), link.pipe(src != link.a)
            for p in (fwd, back):
                self._wake[p] = asyncio.Event()
            pair = (writer, up_writer)
            self._open.setdefault(link, set()).add(pair)
            try:
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(self._feed(reader, fwd))
                    tg.create_task(self._deliver(fwd, up_writer))
                    tg.create_task(self._feed(up_reader, back))
                    tg.create_task(self._deliver(back, writer))
                clean = True
            finally:
                self._open.get(link, set()).discard(pair)
                for p in (fwd, back):
                    link.drop(p)
                    self._wake.pop(p, None)
        except* (ConnectionError, OSError):
            pass  # one end went away: the other is reset below, as the real peer's reset would
        finally:
            for w in (writer, up_writer):
                if w is not None:
                    # Both ends said all they had and were half-closed: close keeps what is buffered.
                    w.close() if clean else w.transport.abort()

    async def _feed(self, reader: asyncio.StreamReader, pipe: Pipe) -> None:
        """Read what one end sends into its pipe until end of stream (or a reset, which ends it too)."""
        loop = asyncio.get_running_loop()
        while True:
            while pipe.queued_bytes >= MAX_QUEUED_BYTES:
                await asyncio.sleep(0.005)  # the deliverer drains; TCP holds the sender meanwhile
            try:
                chunk = await reader.read(READ_BYTES)
            except (ConnectionError, OSError):
                chunk = b""
            pipe.send(chunk, loop.time())
            self._wake[pipe].set()
            if not chunk:
                return

    async def _deliver(self, pipe: Pipe, writer: asyncio.StreamWriter) -> None:
        """Write the pipe's chunks to the other end as they arrive; half-close it at end of stream."""
        loop = asyncio.get_running_loop()
        while True:
            wake = self._wake[pipe]
            due = pipe.next_due()
            if due is None or due > loop.time():
                wake.clear()
                timeout = None if due is None else due - loop.time()
                try:
                    await asyncio.wait_for(wake.wait(), timeout)
                except asyncio.TimeoutError:
                    pass
                continue
            for chunk in pipe.pop_due(loop.time()):
                if not chunk:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(chunk)
            await writer.drain()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close the connection with a TCP reset (RST), not an orderly end of stream (FIN)."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass  # already closed
    writer.transport.abort()


class EmulatorThread:
    """An :class:`Emulator` on its own event loop in a daemon thread, driven from any other thread.

    Example::

        emu = EmulatorThread({"10.0.0.2": "client"})
        port = emu.listen(Listener("node", ("10.0.1.1", 7701), ("10.0.2.2", 7701)))
        emu.set_link("client", "node", LinkSpec(delay_s=0.025, rate_bps=12.5e6))
        ...
        emu.close()
    """

    def __init__(self, hosts: dict[str, str], default: LinkSpec = LinkSpec()) -> None:
        self._loop = asyncio.new_event_loop()
        self.emulator = Emulator(hosts, default)
        self._thread = threading.Thread(target=self._loop.run_forever, name="netem", daemon=True)
        self._thread.start()

    def _call(self, coro, timeout_s: float = 10.0):
        fut: Future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return fut.result(timeout_s)

    def listen(self, listener: Listener) -> int:
        """See :meth:`Emulator.listen`. Raises OSError when the address cannot be bound."""
        return self._call(self.emulator.listen(listener))

    def _on_loop(self, fn, *args):
        """``fn(*args)`` run on the emulator's loop thread; returns its result."""
        async def call():
            return fn(*args)
        return self._call(call())

    def set_link(self, a: str, b: str, spec: LinkSpec) -> None:
        """See :meth:`Emulator.set_link`."""
        self._on_loop(self.emulator.set_link, a, b, spec)

    def reset(self, a: str, b: str) -> int:
        """See :meth:`Emulator.reset`."""
        return self._on_loop(self.emulator.reset, a, b)

    def stats(self) -> dict[str, dict]:
        """See :meth:`Emulator.stats`."""
        return self._on_loop(self.emulator.stats)

    def close(self) -> None:
        try:
            self._call(self.emulator.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
