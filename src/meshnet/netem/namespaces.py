"""Hosts on one machine, each in its own network namespace, joined only through the link emulator.

The topology is a star: a *hub* namespace, where the emulator (:mod:`meshnet.netem.control`) runs, and
one namespace per host, joined to the hub by a veth pair. Host ``k`` (1-based) has a private address
``10.77.k.2`` on its ``eth0`` and a default route through the hub (``10.77.k.1``). Its *public* address,
``10.78.0.k``, which the other hosts dial and which it advertises, belongs to the hub, where the
emulator listens on it and forwards to the private address. The hub does not forward packets
(``ip_forward`` stays 0 in a new namespace), so every byte between two hosts crosses the emulator and
the emulator knows each connection's source host from its source address. No host uses loopback.

Needs root (``ip netns``, ``ip link``); :func:`probe` says why not when it cannot work here.
Namespace names are ``mnet-PID-N-...``: unique per process, and :func:`remove_stale` deletes those of
processes that are gone (a run that was killed before it could clean up).
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
from dataclasses import dataclass

PRIVATE_NET, PUBLIC_NET = "10.77", "10.78.0"
_counter = itertools.count()
_NAME = re.compile(r"^mnet-(\d+)-\d+-")


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no ``ip``, a kernel or sandbox that refuses)."""


def _ip(*args: str) -> None:
    try:
        r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    except FileNotFoundError:
        raise NetnsUnavailable("the `ip` command (iproute2) is not installed") from None
    if r.returncode != 0:
        raise NetnsUnavailable(f"`ip {' '.join(args)}` failed: {r.stderr.strip() or r.returncode}")


def probe() -> None:
    """Raises NetnsUnavailable, saying why, unless namespaces and veth pairs can be made here."""
    if os.geteuid() != 0:
        raise NetnsUnavailable("network namespaces need root (this process runs as uid %d)" % os.geteuid())
    topo = Topology(["probe"])
    try:
        topo.create()
        _ip("netns", "exec", topo.hosts["probe"].ns, "ip", "link", "show", "eth0")  # entering one works too
    finally:
        topo.destroy()


def remove_stale() -> list[str]:
    """Delete the namespaces this module made in processes that no longer run, after killing what
    such a process left running in them; returns their names."""
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    gone = []
    for line in r.stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = _NAME.match(name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            gone.append(name)
    return gone


@dataclass(frozen=True)
class Host:
    name: str
    ns: str
    private_ip: str  # where its services listen
    public_ip: str  # what the others dial (the emulator's listener for it)


class Topology:
    """A hub namespace and one namespace per named host (names: letters, digits, ``-``, ``_``).

    ``create()`` makes them (raises NetnsUnavailable with ``ip``'s words); ``destroy()`` deletes them
    and is safe to call twice, or after a failed ``create()``."""

    def __init__(self, hosts: list[str]) -> None:
        if len(hosts) > 250:
            raise ValueError("at most 250 hosts")
        self.prefix = f"mnet-{os.getpid()}-{next(_counter)}-"
        self.hub = self.prefix + "hub"
        self.hosts = {name: Host(name, self.prefix + name, f"{PRIVATE_NET}.{k}.2", f"{PUBLIC_NET}.{k}")
                      for k, name in enumerate(hosts, start=1)}
        self._made: list[str] = []

    def create(self) -> None:
        self._add_ns(self.hub)
        _ip("-n", self.hub, "link", "set", "lo", "up")
        for k, h in enumerate(self.hosts.values(), start=1):
            self._add_ns(h.ns)
            _ip("-n", self.hub, "link", "add", f"h{k}", "type", "veth", "peer", "name", "eth0", "netns", h.ns)
            _ip("-n", self.hub, "addr", "add", f"{PRIVATE_NET}.{k}.1/24", "dev", f"h{k}")
            _ip("-n", self.hub, "link", "set", f"h{k}", "up")
            _ip("-n", self.hub, "addr", "add", f"{h.public_ip}/32", "dev", "lo")
            _ip("-n", h.ns, "addr", "add", f"{h.private_ip}/24", "dev", "eth0")
            _ip("-n", h.ns, "link", "set", "eth0", "up")
            _ip("-n", h.ns, "link", "set", "lo", "up")
            _ip("-n", h.ns, "route", "add", "default", "via", f"{PRIVATE_NET}.{k}.1")

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)

    def destroy(self) -> None:
        # Deleting a namespace removes its end of each veth pair, and with it the other end.
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self._made.clear()

    def argv(self, host: str | None, argv: list[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace (None: the hub's)."""
        return ["ip", "netns", "exec", self.hub if host is None else self.hosts[host].ns, *argv]

    def address_map(self) -> dict[str, str]:
        """Private IP -> host name: how the emulator names a connection's source."""
        return {h.private_ip: h.name for h in self.hosts.values()}
