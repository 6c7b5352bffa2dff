"""Whether a node answers at the address it registers with ``--advertise``, asked from its own machine.

Clients and other nodes dial only the advertised address. A wrong one (a typo, another machine's address,
a port forwarded nowhere) left the node serving, registered, and silent, while every client that was
routed to it waited for it and routed around it; without TLS (whose certificate check names the host)
nothing said why. A node with ``--advertise`` therefore calls its own Health there once it serves, and
warns when nobody answers or another process does. From the node's own machine a public address may not
loop back through a NAT router that does answer from outside: the warning says so.
"""

from __future__ import annotations

import logging

import grpc

from meshnet.proto import meshnet_pb2 as pb
from meshnet.proto import meshnet_pb2_grpc as pb_grpc
from meshnet.wire.security import open_channel

log = logging.getLogger("meshnet.node")

# How long the node waits for its own answer at the advertised address, seconds: a reachable address
# answers within a round trip, and the check runs in the background.
CHECK_TIMEOUT_S = 3.0

# Answers this node never gives its own Health call (it sends its own join token, and serves Health): a
# tracker (which serves no Node service), or a node of another mesh (another join token), answered.
_ANSWERED_BY_ANOTHER = frozenset({grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAUTHENTICATED,
                                  grpc.StatusCode.PERMISSION_DENIED})


def advertised_address_problem(address: str, instance: str, join_token: str | None = None,
                               tls_ca: str | None = None, timeout_s: float = CHECK_TIMEOUT_S) -> str | None:
    """Why this node (its Health ``instance``) may not be reachable at ``address`` (its ``--advertise``),
    or None when it answers there itself."""
    channel = open_channel(address, join_token, tls_ca)
    try:
        reply = pb_grpc.NodeStub(channel).Health(pb.Empty(), timeout=timeout_s)
    except grpc.RpcError as e:
        code = e.code()
        why = (f"no answer within {timeout_s:g} s" if code is grpc.StatusCode.DEADLINE_EXCEEDED
               else f"{code.name}: {e.details() or ''}".rstrip(": "))
        if code in _ANSWERED_BY_ANOTHER:  # a gRPC server answered, and this node would not answer so
            return (f"another process answers at this node's advertised address {address} ({why}): clients "
                    "and other nodes dial that address and reach it instead; check --advertise HOST:PORT")
        return (f"this node does not answer at its advertised address {address} from its own machine ({why}); "
                "clients and other nodes dial that address: check --advertise HOST:PORT (a router that "
                "forwards its public address from outside but not from inside gives this too)")
    finally:
        channel.close()
    if reply.instance and reply.instance != instance:
        return (f"another meshnet process answers at this node's advertised address {address}: clients and "
                "other nodes dial that address and reach it instead; check --advertise HOST:PORT")
    return None


def check_advertised_address(address: str, instance: str, join_token: str | None, tls_ca: str | None) -> None:
    """Log a warning when :func:`advertised_address_problem` finds one (run on a thread of its own)."""
    try:
        problem = advertised_address_problem(address, instance, join_token, tls_ca)
    except Exception as e:  # noqa: BLE001 - a check that cannot run must not take the node down
        problem = f"could not check the advertised address {address}: {type(e).__name__}: {e}"
    if problem is not None:
        log.warning("%s", problem)
