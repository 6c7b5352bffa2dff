"""Addresses of mesh services: ``host:port`` as written and checked, and the host other machines dial
for a server bound to every interface (0.0.0.0, ::), which nobody can dial as such."""

from __future__ import annotations

import ipaddress
import os
import socket
from urllib.parse import unquote

# The longest address a node may register, characters: a DNS name (253) and a port, with room to spare.
MAX_ADDRESS_CHARS = 300


def format_address(host: str, port: int) -> str:
    """``host:port``, bracketing IPv6 literals (``[::1]:7700``)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def check_address(address: str) -> None:
    """Raises ValueError unless ``address`` is ``host:port`` with a port in 1..65535 (no scheme: gRPC
    would take ``http://host:port`` for a host name it cannot resolve, and retry it without end)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"bad address {address!r}: expected HOST:PORT with a port in 1..65535")
    if "/" in host:
        raise ValueError(f"bad address {address!r}: expected HOST:PORT without a scheme or path, "
                         f"e.g. 127.0.0.1:7700")
    if any(c.isspace() for c in host):
        raise ValueError(f"bad address {address!r}: a host name has no spaces")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise ValueError(f"bad address {address!r}: an IPv6 address goes in brackets, e.g. [::1]:7700")


# Bind addresses meaning "every interface": listening there is fine, but nobody can dial them.
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]", ""})


def dialable_host(bind_host: str, tracker: str | None) -> str:
    """The host other machines dial for a server bound to ``bind_host``: ``bind_host`` itself, unless it
    is a wildcard (0.0.0.0, ::), which no other machine can dial: then this machine's address on the
    route to ``tracker`` (``host:port``; the address the tracker sees it from, found with an unconnected
    UDP socket's ``connect``, which sends nothing), of IPv4 for 0.0.0.0. Where that route is loopback (a
    tracker on this machine, dialled as 127.0.0.1), the address of the interface the default route leaves
    by instead, if there is one: a node bound to every interface is meant for other machines too, and a
    loopback address handed to them in routes was refused their connections, with no warning anywhere.
    ``bind_host`` when there is no tracker or no route to it."""
    if bind_host not in WILDCARD_HOSTS or not tracker:
        return bind_host
    host, _, port = tracker.rpartition(":")
    family = socket.AF_INET if bind_host == "0.0.0.0" else socket.AF_UNSPEC
    try:
        family, _, _, _, address = socket.getaddrinfo(host.strip("[]"), int(port), family, socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)
            found = probe.getsockname()[0]
    except (OSError, ValueError):  # unresolvable, unreachable, or no port
        return bind_host
    if is_loopback_host(found) and tracker != _ELSEWHERE:  # (this_machine_address asks for _ELSEWHERE's route)
        if (elsewhere := this_machine_address(bind_host)) not in WILDCARD_HOSTS:
            return elsewhere
    return found


# Where a route to "another machine" is looked up: TEST-NET-1 (RFC 5737), which no packet is sent to.
_ELSEWHERE = "192.0.2.1:9"


def this_machine_address(bind_host: str) -> str:
    """The host other machines reach a server bound to ``bind_host`` by: ``bind_host`` itself, or for a
    wildcard (0.0.0.0, ::) the address of the interface this machine's default route leaves by (the
    same lookup as :func:`dialable_host`); the wildcard when there is no such route."""
    return dialable_host(bind_host, _ELSEWHERE)


def bind_problem(host: str, port: int) -> str | None:
    """Why nothing here could listen on ``host:port`` (taken, not an address of this machine), in the
    system's words ("Address already in use"), or None; tried with a plain socket closed at once."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        socket.create_server((host.strip("[]"), port), family=family).close()
    except OSError as e:
        return os_reason(e)
    return None


def os_reason(e: OSError) -> str:
    """Why a socket could not listen, in the errno's own words ("Address already in use"): asyncio and
    ``socket.create_server`` append the address to ``strerror``, which a message naming the address then
    said twice. ``str(e)`` for an error without a system errno (a name that does not resolve)."""
    return os.strerror(e.errno) if e.errno and e.errno > 0 else str(e)


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def _is_own_address(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether ``ip`` is an address of this machine: a socket can be bound to it only then."""
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((str(ip), 0))
        return True
    except OSError:
        return False


# Names every resolver maps to loopback (RFC 6761 reserves ``localhost`` and its subdomains; the others are
# Debian's and glibc's /etc/hosts defaults).
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (a name or address, IPv6 bare or bracketed) is this machine's loopback only:
    ``localhost`` (any case, a trailing dot, its subdomains and the usual aliases), 127.0.0.0/8 in any
    form ``inet_aton`` reads (``127.1``), ``::1`` and ``::ffff:127.x.x.x``. A server bound there is out
    of other machines' reach."""
    name = host.strip("[]").lower().rstrip(".")
    if name in _LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    ip = _ip(name)
    if ip is None and name and all(part.isdigit() for part in name.split(".")):
        try:  # the shorthand forms of IPv4 that the resolver takes: 127.1, 2130706433
            ip = ipaddress.IPv4Address(socket.inet_aton(name))
        except OSError:
            return False
    if ip is None:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def is_loopback_address(address: str) -> bool:
    """Whether the host of ``address`` (``HOST:PORT``) is loopback only (:func:`is_loopback_host`)."""
    return is_loopback_host(address.rpartition(":")[0])


def on_another_machine(address: str) -> bool:
    """Whether ``address`` (``HOST:PORT``) names an IP address of another machine: not loopback, not one of
    this machine's. False for a host name (telling would take resolving it)."""
    ip = _ip(address.rpartition(":")[0].strip("[]"))
    return ip is not None and not ip.is_loopback and not _is_own_address(ip)


def peer_host(peer: str) -> str | None:
    """The host of gRPC peer ``peer`` (``ipv4:10.0.0.5:41234`` -> ``10.0.0.5``, ``ipv6:%5B::1%5D:41234`` ->
    ``[::1]``: gRPC percent-encodes an IPv6 peer's brackets), or None for a peer that is not an IP address
    (a unix socket)."""
    kind, _, rest = unquote(peer).partition(":")
    return rest.rpartition(":")[0] if kind in ("ipv4", "ipv6") else None


def loopback_seen_from_elsewhere(advertised: str, peer: str) -> str | None:
    """Why ``advertised`` (a node's ``host:port``) cannot serve the mesh it registers with from gRPC peer
    ``peer`` (``ipv4:10.0.0.5:41234``, ``ipv6:[::1]:41234``): its host is a loopback address (127.0.0.0/8,
    ::1, localhost), which only its own machine can dial, while the registration came from another
    machine. None where it can be dialled, or where that cannot be told (a host name, a unix socket)."""
    if not is_loopback_address(advertised):
        return None
    if (host := peer_host(peer)) is None:
        return None
    peer_ip = _ip(host)
    if peer_ip is not None and getattr(peer_ip, "ipv4_mapped", None) is not None:
        peer_ip = peer_ip.ipv4_mapped  # an IPv4 client of a tracker listening on ::
    if peer_ip is None or peer_ip.is_loopback or _is_own_address(peer_ip):
        return None
    return (f"{advertised} is a loopback address, which only its own machine can dial, but it registered from "
            f"{peer_ip}: start the node with --host 0.0.0.0 (or its address), with --advertise HOST:PORT where "
            f"others reach it by another address")
