"""Who may talk to a mesh service: a shared join token, optional TLS, and the channel options both use.

Server side: :class:`JoinTokenInterceptor` refuses calls without the right ``x-meshnet-join-token``
metadata (UNAUTHENTICATED); :func:`add_port` binds plaintext or TLS (:class:`TlsConfig`);
:func:`make_server` builds a ``grpc.Server`` with both and :data:`SERVER_OPTIONS`.
Client side: :func:`open_channel` attaches the token to every call and verifies the server's certificate
against a CA file when one is given.

The join token keeps strangers out of a mesh; it is a bearer secret, so send it over TLS on any network
you do not trust.
"""

from __future__ import annotations

import collections
import functools
import hmac
import logging
import ssl
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import grpc

from meshnet.wire.addresses import bind_problem, check_address, peer_host
from meshnet.wire.request_decoding import RequestDecodingInterceptor

JOIN_TOKEN_METADATA = "x-meshnet-join-token"
# Trailing metadata of a refusal that may pass (a node's RESOURCE_EXHAUSTED, the tracker's ALREADY_EXISTS
# for an id whose entry may expire): seconds after which asking again may succeed.
RETRY_AFTER_METADATA = "retry-after-s"
# Env variable the CLI reads the join token from when no flag gives it.
JOIN_TOKEN_ENV = "MESHNET_JOIN_TOKEN"

MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # envelopes are framed at 1 MiB; 16 MiB leaves room for everything else

# Client keepalive: ping after 20 s without traffic and give the peer 10 s to answer, so a vanished
# peer is noticed in about half a minute even while a channel sits idle between sessions. Cheap on
# loopback and LANs; the servers below are told to accept pings this frequent.
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Each channel keeps its own connections. gRPC shares them process-wide by default, so a channel to
    # an address whose last server died (a node restarted on its port, a port the OS handed out again)
    # would fail at once with the dead server's cached "connection refused" until the backoff expires.
    ("grpc.use_local_subchannel_pool", 1),
    # Reconnect at least every 2 s. gRPC's backoff grows to 120 s by default, and a call in between
    # fails at once without trying: nodes took 20-65 s to register again with a restarted tracker, and
    # the mesh routed nothing meanwhile. A connection attempt every 2 s to a peer that is gone costs nothing.
    # (Not grpc.min_reconnect_backoff_ms: it is also the minimum time an attempt may take to connect,
    # 20 s by default, and at 0.5 s a TLS handshake over a slow link never finished.)
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 2000),
]

# gRPC servers by default answer a client pinging more often than every 5 minutes with GOAWAY
# ("too_many_pings"); accept the client keepalive above (with margin) instead.
SERVER_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 0),
    # gRPC sets SO_REUSEPORT on Linux by default, so a second server on a busy port would "start" and
    # share the port with the first; binding must fail instead.
    ("grpc.so_reuseport", 0),
]


@dataclass(frozen=True)
class TlsConfig:
    """A server's TLS certificate chain and private key, both PEM file paths."""

    cert: str
    key: str


# ---- server side ---------------------------------------------------------------------------------------

log = logging.getLogger("meshnet.security")

# A caller refused for its join token is logged at most this often per address and reason, seconds: the
# operator learns that a node or client comes with a wrong or no token (it said nothing at all), and a
# scanner knocking every second does not fill the log.
REFUSAL_LOG_S = 60.0


class _RefusalLog:
    """Rate-limited warnings of refused callers (thread-safe; at most 1024 addresses remembered)."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()

    def note(self, peer: str, reason: str, method: str) -> None:
        """``peer`` as gRPC gives it (``ipv4:10.0.0.5:41234``, ``ipv6:%5B::1%5D:41234``)."""
        host = peer_host(peer) or peer
        now = time.monotonic()
        with self._lock:
            if now - self._last.get((host, reason), -REFUSAL_LOG_S) < REFUSAL_LOG_S:
                return
            if len(self._last) >= 1024:
                self._last.clear()
            self._last[(host, reason)] = now
        log.warning("refused %s from %s: %s (logged once a minute per address)", method, host, reason)


class JoinTokenInterceptor(grpc.ServerInterceptor):
    """Refuse every call whose ``x-meshnet-join-token`` metadata is not ``token``.

    Refusals are UNAUTHENTICATED with "missing join token" or "wrong join token"; the comparison is
    constant-time (``hmac.compare_digest``) so the token cannot be guessed byte by byte from timings.

    Raises:
        ValueError: ``token`` is empty.
    """

    def __init__(self, token: str):
        if not token:
            raise ValueError("join token is empty; pass None to serve without one")
        self._token = token.encode()
        self._refusals = _RefusalLog()

    def intercept_service(self, continuation, handler_call_details):
        supplied = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == JOIN_TOKEN_METADATA:
                supplied = value.encode() if isinstance(value, str) else bytes(value)
                break
        if supplied is not None and hmac.compare_digest(supplied, self._token):
            return continuation(handler_call_details)
        reason = "missing join token" if supplied is None else "wrong join token"
        message = reason + (f": this service requires the mesh's join token in metadata {JOIN_TOKEN_METADATA!r} "
                            f"(--join-token or {JOIN_TOKEN_ENV})")
        handler = continuation(handler_call_details)
        if handler is None:  # unknown method: let gRPC answer UNIMPLEMENTED as usual
            return None
        return _refusing_handler(handler, grpc.StatusCode.UNAUTHENTICATED, message,
                                 lambda peer: self._refusals.note(peer, reason, handler_call_details.method))


def _refusing_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str,
                      refused: Callable[[str], None] | None = None) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that aborts every call with ``code``, telling ``refused``
    the caller's address first."""

    def refuse(request_or_iterator, context):
        if refused is not None:
            refused(context.peer())
        context.abort(code, message)

    # Requests stay raw bytes: a refused call's payload is never parsed.
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


def _read_pem(path: str, what: str) -> bytes:
    try:
        if not Path(path).is_file():  # a FIFO or a device would block the read, or never end it
            raise ValueError(f"cannot read TLS {what} {path!r}: "
                             f"{'not a regular file' if Path(path).exists() else 'No such file or directory'}")
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read TLS {what} {path!r}: {e.strerror or e}") from None


def server_credentials(cert_path: str, key_path: str) -> grpc.ServerCredentials:
    """TLS credentials from PEM files: the certificate (chain) and its private key.

    Raises:
        ValueError: a file cannot be read, is not PEM, or the key does not match the certificate (the
            message names it).
    """
    # gRPC takes any bytes here and fails later with "Failed to bind": load them once to name the problem.
    server_ssl_context(TlsConfig(cert_path, key_path))
    return grpc.ssl_server_credentials([(_read_pem(key_path, "private key"), _read_pem(cert_path, "certificate"))])


def server_ssl_context(tls: TlsConfig) -> ssl.SSLContext:
    """A TLS server context for the step data plane, from the same PEM files as the node's gRPC port.

    TLS 1.2 at least; no session tickets (TLS 1.3 sends them after the handshake, and a client checking
    an idle pooled connection for unexpected bytes would see them).

    Raises:
        ValueError: a file cannot be read or the key does not match the certificate (the message names it).
    """
    _read_pem(tls.cert, "certificate")
    _read_pem(tls.key, "private key")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.num_tickets = 0
    try:
        ctx.load_cert_chain(tls.cert, tls.key)
    except ssl.SSLError as e:
        raise ValueError(f"TLS certificate {tls.cert!r} and key {tls.key!r} do not load as a PEM certificate and "
                         f"its private key: {e.reason or e}") from None
    _check_validity(tls.cert)
    return ctx


def _check_validity(cert_path: str) -> None:
    """Raise ValueError when the (first) certificate in ``cert_path`` is expired or not valid yet: a server
    starting with it would run, and every client would refuse its handshake."""
    import datetime

    from cryptography import x509

    cert = x509.load_pem_x509_certificate(Path(cert_path).read_bytes())
    now = datetime.datetime.now(datetime.timezone.utc)
    if now > cert.not_valid_after_utc:
        raise ValueError(f"TLS certificate {cert_path!r} expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC: "
                         "clients would refuse it")
    if now < cert.not_valid_before_utc:
        raise ValueError(f"TLS certificate {cert_path!r} is not valid before "
                         f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC (is this machine's clock right?)")


def unnamed_host_problem(cert_path: str, host: str) -> str | None:
    """Why clients would refuse ``cert_path`` at ``host`` (an IP address or DNS name this server is dialled
    by), or None. The rules are OpenSSL's ``X509_check_host`` / ``X509_check_ip``, which gRPC and
    :func:`client_ssl_context` use: an IP address must be a subjectAltName IP entry; a name must match a
    DNS entry (case-blind, exactly as written otherwise, ``*.`` standing for one leftmost label of a name
    with two more labels at least), or, where there is no DNS entry, the subject's common name. A node
    registered at a host its certificate does not name started, and every client's handshake with it
    failed, with "Hostname Verification Check failed" in the client's log only."""
    import ipaddress

    from cryptography import x509
    from cryptography.x509.oid import NameOID

    cert = x509.load_pem_x509_certificate(Path(cert_path).read_bytes())
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        ips, names = san.get_values_for_type(x509.IPAddress), san.get_values_for_type(x509.DNSName)
    except x509.ExtensionNotFound:
        ips, names = [], []
    common = [a.value for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME) if isinstance(a.value, str)]
    try:
        if ipaddress.ip_address(host.strip("[]")) in ips:
            return None
    except ValueError:  # a DNS name
        want = host.lower()
        for name in (n.lower() for n in (names or common)):
            if name == want or (name.startswith("*.") and name.count(".") >= 2 and "." in want
                                and want.partition(".")[2] == name[2:]):
                return None
    named = ", ".join([str(ip) for ip in ips] + (names or [f"CN={c}" for c in common])) or "nothing"
    return (f"TLS certificate {cert_path!r} names {named}, not {host}, the address this node registers: "
            f"every client dialling it would refuse the handshake; add {host} to its subjectAltName, or pass "
            f"--advertise with an address it names")


@functools.lru_cache(maxsize=8)
def client_ssl_context(tls_ca: str | None) -> ssl.SSLContext:
    """A TLS client context verifying servers with the CA file ``tls_ca`` (PEM; None: the system's CAs),
    checking the certificate's names against the host dialled, as :func:`open_channel` does for gRPC.

    Raises:
        ValueError: ``tls_ca`` cannot be read or holds no certificate.
    """
    if tls_ca is not None:
        _read_pem(tls_ca, "CA certificate")
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=tls_ca)
    except ssl.SSLError as e:
        raise ValueError(f"cannot read TLS CA certificate {tls_ca!r}: {e.reason or e}") from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def add_port(server: grpc.Server, address: str, tls: TlsConfig | None) -> int:
    """Bind ``server`` to ``address`` (``host:port``; port 0 picks a free one), over TLS when ``tls`` is set.

    Returns:
        The bound port.

    Raises:
        RuntimeError: the address cannot be bound (in use, bad host), saying why; ValueError: unreadable
            TLS files.
    """
    host, _, port = address.rpartition(":")
    if port.isdigit() and int(port):
        # Tried with a plain socket first: gRPC's own failure says only "Failed to bind", after logging
        # a C-level error line of its own to stderr.
        if (why := bind_problem(host, int(port))) is not None:
            raise RuntimeError(f"cannot listen on {address}: {why}")
    try:
        if tls is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, server_credentials(tls.cert, tls.key))
    except RuntimeError:
        port = 0  # gRPC says only "Failed to bind", with a hint about its debug logging
    if not port:
        raise RuntimeError(f"cannot listen on {address}: the port is taken, or the host is not an address of "
                           f"this machine")
    return port


def make_server(join_token: str | None = None, max_workers: int = 16,
                interceptors: Sequence[grpc.ServerInterceptor] = (),
                maximum_concurrent_rpcs: int | None = None) -> grpc.Server:
    """A thread-pool ``grpc.Server`` with :data:`SERVER_OPTIONS`, refusing calls without ``join_token``
    when one is given, and requests that do not parse with INVALID_ARGUMENT
    (:class:`~meshnet.wire.request_decoding.RequestDecodingInterceptor`). With ``maximum_concurrent_rpcs``
    set, calls beyond it are refused at once with RESOURCE_EXHAUSTED instead of queueing without bound.
    Bind it with :func:`add_port`, then ``start()``."""
    chain = [JoinTokenInterceptor(join_token)] if join_token else []
    chain.append(RequestDecodingInterceptor())
    chain.extend(interceptors)
    return grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), interceptors=chain,
                       options=SERVER_OPTIONS, maximum_concurrent_rpcs=maximum_concurrent_rpcs)


# ---- client side ---------------------------------------------------------------------------------------

class _CallDetails(collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
        grpc.ClientCallDetails):
    pass


class _MetadataInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                           grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds fixed metadata to every call, whatever its kind."""

    def __init__(self, extra: Sequence[tuple[str, str]]):
        self._extra = tuple(extra)

    def _details(self, d: grpc.ClientCallDetails) -> _CallDetails:
        metadata = list(d.metadata or ()) + list(self._extra)
        return _CallDetails(d.method, d.timeout, metadata, d.credentials,
                            getattr(d, "wait_for_ready", None), getattr(d, "compression", None))

    def _call(self, continuation: Callable, details, request):
        return continuation(self._details(details), request)

    intercept_unary_unary = _call
    intercept_unary_stream = _call
    intercept_stream_unary = _call
    intercept_stream_stream = _call


def open_channel(address: str, join_token: str | None = None, tls_ca: str | None = None,
                 tls_server_name: str | None = None) -> grpc.Channel:
    """A channel to a mesh service (tracker or node) at ``host:port``.

    Args:
        address: ``host:port`` of the service.
        join_token: sent as ``x-meshnet-join-token`` metadata on every call when given.
        tls_ca: PEM file of the CA (or the self-signed certificate itself) to verify the server with;
            None = plaintext. gRPC checks the certificate's subject alternative names against the host
            in ``address``, and matches IP SANs too, so a self-signed certificate with
            ``DNS:localhost, IP:127.0.0.1`` serves both ``localhost:PORT`` and ``127.0.0.1:PORT``.
        tls_server_name: the name to verify instead of the address's host (gRPC's
            ``grpc.ssl_target_name_override``), for a certificate issued to a name other than the one
            dialled, e.g. dialling a LAN IP with a certificate for ``localhost``.

    Returns:
        A channel with :data:`CHANNEL_OPTIONS`; close it with ``close()`` (or use it in ``with``).

    Raises:
        ValueError: ``address`` is not ``host:port`` with a port in 1..65535, or ``tls_ca`` cannot be read
            or holds no certificate.
    """
    check_address(address)
    options = list(CHANNEL_OPTIONS)
    if tls_ca is None:
        channel = grpc.insecure_channel(address, options=options)
    else:
        client_ssl_context(tls_ca)  # gRPC would retry a CA file that holds no certificate forever
        creds = grpc.ssl_channel_credentials(root_certificates=_read_pem(tls_ca, "CA certificate"))
        if tls_server_name:
            options.append(("grpc.ssl_target_name_override", tls_server_name))
        channel = grpc.secure_channel(address, creds, options=options)
    if join_token:
        channel = grpc.intercept_channel(channel, _MetadataInterceptor([(JOIN_TOKEN_METADATA, join_token)]))
    return channel
