"""Why a gRPC call to a mesh service failed, in words a user can act on: a TLS setting that does not match
the server's, an address that serves no tracker, a refused join token, and how long a refusal asked the
caller to wait. These are failures no retry mends, told apart from the ones a retry may (a server
restarting, a node busy)."""

from __future__ import annotations

import time

import grpc

from meshnet.wire.security import RETRY_AFTER_METADATA, open_channel


def tls_mismatch(e: grpc.RpcError, tls_ca: str | None) -> str | None:
    """Why a failed call means this side's TLS setting does not match the server's (which no retry
    mends), or None. gRPC's own words are a handshake's: a plaintext client meeting a TLS server sees
    only the socket close."""
    details = e.details() or ""
    if e.code() is not grpc.StatusCode.UNAVAILABLE:
        return None
    if tls_ca is None and "Socket closed" in details:
        return "a server speaking TLS closes plaintext connections so: pass --tls-ca with its CA"
    if tls_ca is not None and "WRONG_VERSION_NUMBER" in details:
        return "the server does not speak TLS: drop --tls-ca"
    if tls_ca is not None and "CERTIFICATE_VERIFY_FAILED" in details:
        return f"its certificate does not verify with the CA in --tls-ca {tls_ca}"
    if tls_ca is not None and "Hostname Verification Check failed" in details:
        return ("its certificate does not name the address dialled: give it a subjectAltName with that IP or "
                "DNS name (see the README's TLS paragraph), or dial a name it holds")
    return None


def not_a_tracker(e: grpc.RpcError) -> str | None:
    """Why a failed call to a tracker means the address serves something else (which no retry mends),
    or None: gRPC without the tracker's service answers UNIMPLEMENTED, an HTTP/1 server breaks the
    HTTP/2 handshake."""
    if e.code() is grpc.StatusCode.UNIMPLEMENTED:
        return ("that address serves gRPC without this tracker call: a node's port (give the tracker's), or a "
                "tracker older than this client")
    details = e.details() or ""
    if e.code() is grpc.StatusCode.UNAVAILABLE and "Failed parsing HTTP/2" in details:
        if "got frame type 0)" in details:  # the first bytes a node's data plane answers with
            return "that address is not a gRPC server (a node's --data-port?): give the tracker's"
        return ("that address is not a gRPC server (an HTTP server, such as meshnet api or the dashboard?): "
                "give the tracker's")
    return None


def tracker_mismatch(e: grpc.RpcError, tls_ca: str | None) -> str | None:
    """:func:`tls_mismatch` or :func:`not_a_tracker`: why no retry of a tracker call will work, or None."""
    return tls_mismatch(e, tls_ca) or not_a_tracker(e)


def tracker_hint(e: grpc.RpcError, tls_ca: str | None, tracker: str | None = None) -> str:
    """:func:`tracker_mismatch`'s reason as text to append to the call's own, or "". Given the address
    dialled (``tracker``), a call nothing answered says so too (:func:`no_tracker_at`)."""
    why = tracker_mismatch(e, tls_ca)
    if why is None and tracker is not None and e.code() is grpc.StatusCode.UNAVAILABLE:
        why = no_tracker_at(tracker)
    return f" ({why})" if why else ""


def no_tracker_at(tracker: str) -> str:
    """What a tracker call that nothing answered (UNAVAILABLE) means to the user."""
    return f"no tracker answers at {tracker}: is it running, and is that its address (--tracker HOST:PORT)?"


def tracker_refusal(tracker: str, join_token: str | None, tls_ca: str | None, retry_s: float = 1.0) -> str | None:
    """Why the tracker at ``tracker`` will not have a caller with ``join_token`` and ``tls_ca``, asked
    before a node loads its model or an API starts: its refusal of the token (a missing or wrong one), an
    address that serves no tracker, or TLS settings that do not match its own (asked again after
    ``retry_s`` first: a tracker shutting down closes sockets too). None when it accepts the caller, or
    cannot be asked now (a node then starts and keeps trying to register, as it does when the tracker goes
    away later)."""
    for attempt in range(2):
        e = _list_nodes_error(tracker, join_token, tls_ca, 5.0)
        if e is None:
            return None
        if e.code() is grpc.StatusCode.UNAUTHENTICATED:
            return e.details() or "UNAUTHENTICATED"
        why = tracker_mismatch(e, tls_ca)
        if why is None:
            return None
        if attempt or not_a_tracker(e):
            return f"{e.details()} ({why})"
        time.sleep(retry_s)
    return None


def _list_nodes_error(tracker: str, join_token: str | None, tls_ca: str | None,
                      timeout_s: float) -> grpc.RpcError | None:
    """What a ListNodes call to the tracker at ``tracker``, as a caller with ``join_token`` and ``tls_ca``,
    failed with within ``timeout_s`` seconds; None when it was answered."""
    from meshnet.proto import meshnet_pb2 as pb
    from meshnet.proto import meshnet_pb2_grpc as pb_grpc

    channel = open_channel(tracker, join_token, tls_ca)
    try:
        pb_grpc.TrackerStub(channel).ListNodes(pb.Empty(), timeout=timeout_s)
        return None
    except grpc.RpcError as e:
        return e
    finally:
        channel.close()


def abort_call(context, code: grpc.StatusCode, message: str, retry_after_s: float | None = None) -> None:
    """End a gRPC call with ``code`` and ``message``, and with ``retry_after_s`` (the seconds after which
    asking again may succeed) as :data:`RETRY_AFTER_METADATA` trailing metadata when given: what
    :func:`retry_after_s` reads back on the caller's side. Raises, as ``context.abort`` does."""
    if retry_after_s is not None:
        context.set_trailing_metadata(((RETRY_AFTER_METADATA, f"{retry_after_s:.3f}"),))
    context.abort(code, message)


def retry_after_s(e: grpc.RpcError) -> float | None:
    """The seconds a refusal said to wait before asking again (its :data:`RETRY_AFTER_METADATA` trailing
    metadata), or None."""
    for key, value in (e.trailing_metadata() or ()) if hasattr(e, "trailing_metadata") else ():
        if key == RETRY_AFTER_METADATA:
            try:
                return max(0.0, float(value))
            except ValueError:
                return None
    return None
