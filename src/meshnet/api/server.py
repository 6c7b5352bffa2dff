"""Serving the API: ``meshnet api`` and :func:`start_api_in_thread` (what ``meshnet up --api-port`` uses)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time

import uvicorn

from meshnet.arg_types import (LOCAL_STAGE_DEFAULTS, TRACKER_HELP, add_client_id_arg, listen_host, load_setting,
                               mode_problem, model_ref, name_text, port_number, positive_int, positive_number,
                               thread_count, tracker_address)
from meshnet.api.app import MAX_BODY_BYTES, create_app
from meshnet.api.http_protocol import HeaderDeadlineProtocol
from meshnet.api.backend import ApiBackend
from meshnet.load_spec import NO_HUGE_PAGES_HELP
from meshnet.secret_args import API_KEY_ENV, add_api_key_arg, add_join_token_arg
from meshnet.speculative import add_speculation_args, speculation_from_args
from meshnet.wire.addresses import format_address, is_loopback_host, this_machine_address
from meshnet.wire.call_problems import tracker_refusal

log = logging.getLogger("meshnet.api")


# The largest --max-body-mb: a request is JSON text, and a body is read into memory whole.
MAX_BODY_MB = 1024


def body_mb(text: str) -> float:
    """``--max-body-mb``: a number of MiB > 0 and at most :data:`MAX_BODY_MB`."""
    value = positive_number(text)
    if value > MAX_BODY_MB:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_BODY_MB} (MiB), got {text}")
    return value


def add_api_parser(sub) -> None:
    """Add ``meshnet api`` to the subcommands ``sub`` (an ``argparse`` subparsers object)."""
    p = sub.add_parser("api", help="serve an OpenAI-compatible HTTP API (/v1/chat/completions, ...) "
                                   "in front of a mesh")
    p.add_argument("--tracker", type=tracker_address, default=None,
                   help=f"{TRACKER_HELP}; default: run the stages in this process")
    source = p.add_mutually_exclusive_group()  # a file here, or the model the tracker knows: never both
    source.add_argument("--model", default="smollm2",
                        help="GGUF path or bundled name; the file must be readable here (tokenizer, chat template)")
    source.add_argument("--model-id", type=model_ref, default=None, metavar="ID_OR_NAME",
                        help="with --tracker, instead of --model: no file here; the model the tracker knows by "
                             "this id (or 8+ hex digits of it), general.name or bundled name (tokenizer and chat "
                             "template from its manifest)")
    p.add_argument("--name", type=name_text, default=None, help="the model id clients use (default: the bundled name or "
                                                "the file's stem)")
    p.add_argument("--host", type=listen_host, default="127.0.0.1",
                   help="address to listen on (default %(default)s; 0.0.0.0 = every interface)")
    p.add_argument("--port", type=port_number, default=8000, help="port (default %(default)s; 0 = any free port)")
    add_join_token_arg(p, local_without_tracker=True)
    add_api_key_arg(p)
    add_client_id_arg(p)
    p.add_argument("--tls-ca", default=None, help="CA/cert to verify a TLS tracker and nodes")
    p.add_argument("--client-orchestrated", action="store_true",
                   help="with --tracker: " + "every step through the client, hop by hop (default: nodes forward hidden states to the next node themselves where the route allows)")
    p.add_argument("--max-concurrency", type=positive_int, default=None,
                   help="generations at once; more wait (default: 8 for a mesh, the stages' session limit "
                        "in process)")
    p.add_argument("--max-body-mb", type=body_mb, default=MAX_BODY_BYTES / 2**20,
                   help="request body limit, MiB (at most %d)" % MAX_BODY_MB)
    local = p.add_argument_group("in-process stages (without --tracker)")
    split = local.add_mutually_exclusive_group()
    split.add_argument("--stages", type=int, default=None, help="split the layers into N ranges of about equal decode cost")
    split.add_argument("--layers", default=None, help='explicit half-open ranges, e.g. "0:10,10:30"')
    local.add_argument("--threads", type=thread_count, default=LOCAL_STAGE_DEFAULTS["threads"], help="CPU threads per stage (default %(default)s)")
    local.add_argument("--n-ctx", type=load_setting("n_ctx"), default=LOCAL_STAGE_DEFAULTS["n_ctx"],
                       help="context length (0 = model's, capped at 4096)")
    local.add_argument("--max-sessions", type=load_setting("max_sessions"), default=LOCAL_STAGE_DEFAULTS["max_sessions"],
                       help="sessions each stage holds at once")
    local.add_argument("--kv-tokens", type=load_setting("kv_tokens"), default=LOCAL_STAGE_DEFAULTS["kv_tokens"],
                       help="KV cells sessions may reserve at once (0 = half the memory available)")
    local.add_argument("--prefix-cache", type=load_setting("prefix_cache"), default=LOCAL_STAGE_DEFAULTS["prefix_cache"], help="finished sessions kept for prompts that start the same way (exact prefix reuse; 0 = none)")
    local.add_argument("--no-huge-pages", dest="huge_pages", action="store_false", help=NO_HUGE_PAGES_HELP)
    add_speculation_args(p)
    p.set_defaults(func=run_api)


def build_backend(args: argparse.Namespace) -> ApiBackend:
    """The backend ``meshnet api`` serves: a mesh through ``--tracker``, else stages in this process.

    Raises:
        ValueError / ModelNotFound: flags that do not fit the mode, a model missing or unreadable here or
            unknown to the tracker (``meshnet`` exits 2).
        MeshUnavailable: the tracker refuses this caller (join token, TLS, not a tracker) or cannot be
            reached for ``--model-id``'s manifest (``meshnet`` exits 1).
    """
    from meshnet.api.backend import local_backend, mesh_backend, served_name
    from meshnet.client.router import MeshUnavailable

    from meshnet.model.bundled import BUNDLED, resolve_model

    from meshnet.speculative import mtp_problem

    name = args.name
    if problem := mode_problem(args, {"--client-orchestrated": args.client_orchestrated, "--tls-ca": args.tls_ca,
                                      "--client-id": args.client_id}):
        raise ValueError(problem)
    if args.tracker and (refused := tracker_refusal(args.tracker, args.join_token, args.tls_ca)):
        # It served anyway and answered every request 503 with the tracker's refusal. The mesh refused,
        # not the command line: exit status 1, as generate, node and nodes exit on it.
        raise MeshUnavailable(f"--tracker {args.tracker}: {refused}")
    if args.model_id is not None:
        if not args.tracker:
            raise ValueError("--model-id needs --tracker (the tracker holds the model's manifest)")
        from meshnet.client.manifest_source import metadata_gguf, model_name_of

        path, model_id = metadata_gguf(args.tracker, args.model_id, args.join_token, args.tls_ca)
        # a bundled model under its bundled name, as `--model` serves it, however it was named here (its
        # name, its id or a prefix of it); any other model under its general.name
        bundled = next((name for name, b in BUNDLED.items() if b.model_id == model_id), None)
        model_path, name = str(path), name or bundled or model_name_of(path) or args.model_id
    else:
        model_path = str(resolve_model(args.model))
    speculation = speculation_from_args(args, model_path, args.model_id)
    if args.tracker:
        backend = mesh_backend(args.tracker, model_path, join_token=args.join_token, tls_ca=args.tls_ca,
                               name=name or served_name(args.model), max_concurrency=args.max_concurrency or 8,
                               forwarding=not args.client_orchestrated, client_id=args.client_id)
        backend.speculation = speculation
        backend.mtp_problem = mtp_problem(model_path, backend.model_name)
        return backend
    backend = local_backend(args.model, stages=args.stages, layers=args.layers, n_threads=args.threads,
                            n_ctx=args.n_ctx, name=args.name, progress=sys.stderr.isatty(),
                            max_sessions=args.max_sessions, kv_tokens=args.kv_tokens,
                            prefix_cache=args.prefix_cache, huge_pages=args.huge_pages)
    if args.max_concurrency:
        backend.max_concurrency = min(backend.max_concurrency, args.max_concurrency)
    backend.speculation = speculation
    backend.mtp_problem = mtp_problem(model_path, backend.model_name)
    return backend


def run_api(args: argparse.Namespace) -> int:
    """``meshnet api``: serve until Ctrl-C / SIGTERM. Returns the process exit code."""
    logging.basicConfig(level=logging.INFO, format="[meshnet api] %(message)s")
    try:  # before the model loads: a taken port fails at once, and the address it names is where it serves
        sock = bind_http_socket(args.host, args.port)
    except OSError as e:
        print(f"error: the API cannot listen on {format_address(args.host, args.port)} ({e.strerror or e}); pass "
              "another --port (0 = any free port) or --host", file=sys.stderr)
        return 2
    with sock:
        backend = build_backend(args)
        app = create_app(backend, max_body_bytes=int(args.max_body_mb * 2**20), api_key=args.api_key)
        port = sock.getsockname()[1]
        # Bound to every interface: named by this machine's address (default route), as `meshnet up` names it.
        print(f"[meshnet api] serving {backend.model_name!r} on "
              f"http://{format_address(this_machine_address(args.host), port)}/v1 "
              f"(context {backend.n_ctx} tokens{', API key required' if args.api_key else ''})", file=sys.stderr,
              flush=True)
        if warning := open_api_warning(args.host, port, args.api_key, "this model"):
            print(f"[meshnet api] {warning}", file=sys.stderr, flush=True)
        if not backend.tokenizer.chat_template:  # a base model: said now, not first at a chat request's 400
            print(f"[meshnet api] {backend.model_name!r} has no chat template (a base model): /v1/chat/completions "
                  "and /v1/responses refuse messages; send text to /v1/completions", file=sys.stderr, flush=True)
        # uvicorn raises the signal that stopped it again once it has stopped: with SIGTERM's default
        # action the process was killed there (status -15), before the backend closed and before the
        # atexit handlers sent the ledger what the mesh client had not reported yet.
        previous = None
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            _StoppingServer(uvicorn.Config(app, host=args.host, port=port, log_level="warning",
                                           timeout_graceful_shutdown=5, http=HeaderDeadlineProtocol),
                            backend.stopping).run(sockets=[sock])
        finally:
            backend.close()
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
    return 0


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(0)  # unwinds through run_api's finally, then the interpreter's exit (atexit) runs


class _StoppingServer(uvicorn.Server):
    """uvicorn's server, which also sets ``stopping`` when a signal tells it to exit: its generations then
    end at their next token (a 503 ``server_shutdown``; a stream's last event) well within the grace
    period, after which uvicorn cancelled them mid-step (a traceback, and a stream cut without an end)."""

    def __init__(self, config: uvicorn.Config, stopping: threading.Event) -> None:
        super().__init__(config)
        self._stopping = stopping

    def handle_exit(self, sig, frame) -> None:
        if not self._stopping.is_set():  # said once; os.write, since print is not safe in a signal handler
            tasks = len(self.server_state.tasks)  # requests being answered
            os.write(2, ("[meshnet api] stopping" + (f": {tasks} open request(s) end now (server_shutdown)"
                                                     if tasks else "") + "\n").encode())
        self._stopping.set()
        super().handle_exit(sig, frame)


def open_api_warning(host: str, port: int, api_key: str | None, what: str) -> str | None:
    """What an API on ``host:port`` says at start when it has no key and listens beyond loopback (anyone
    who reaches the port can run generations on ``what``), or None."""
    if api_key or is_loopback_host(host):
        return None
    return (f"no API key: anyone who reaches port {port} can run generations on {what} (pass --api-key, or set "
            f"${API_KEY_ENV})")


def start_api_in_thread(backend: ApiBackend, host: str = "127.0.0.1", port: int = 8000,
                        max_body_bytes: int = MAX_BODY_BYTES, log_level: str = "warning",
                        startup_timeout_s: float = 30.0,
                        api_key: str | None = None) -> tuple[uvicorn.Server, threading.Thread]:
    """Serve ``create_app(backend)`` with uvicorn in a daemon thread; see :func:`serve_app_in_thread`."""
    return serve_app_in_thread(create_app(backend, max_body_bytes=max_body_bytes, api_key=api_key), host, port,
                               log_level, startup_timeout_s, name="meshnet-api")


def bind_http_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` as the HTTP servers bind theirs (``SO_REUSEADDR``, IPv6 for an
    address with a colon), not yet listening. Raises OSError when the address cannot be bound (the port
    is taken, or the host is not an address here)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def serve_app_in_thread(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning",
                        startup_timeout_s: float = 30.0, name: str = "meshnet-http"
                        ) -> tuple[uvicorn.Server, threading.Thread]:
    """Serve the ASGI ``app`` with uvicorn in a daemon thread; returns once it accepts connections.

    Args:
        port: TCP port; 0 picks a free one. The bound port is in ``server.config.port`` on return.
        name: the thread's name, followed by the port.
    Returns:
        ``(server, thread)``; stop with :func:`stop_api`.
    Raises:
        OSError: the address cannot be bound (e.g. the port is in use).
        RuntimeError: the server did not start within ``startup_timeout_s`` seconds.
    """
    sock = bind_http_socket(host, port)
    sock.set_inheritable(True)
    bound = sock.getsockname()[1]
    config = uvicorn.Config(app, host=host, port=bound, log_level=log_level, timeout_graceful_shutdown=5,
                            http=HeaderDeadlineProtocol,
                            lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=f"{name}-{bound}", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"the HTTP server on {format_address(host, bound)} exited during startup")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"the HTTP server on {format_address(host, bound)} did not start in "
                               f"{startup_timeout_s:.0f}s")
        time.sleep(0.02)
    return server, thread


def stop_api(server: uvicorn.Server, thread: threading.Thread, timeout_s: float = 10.0) -> None:
    """Ask the server to exit (open streams get a few seconds to finish) and wait for its thread."""
    server.should_exit = True
    thread.join(timeout_s)
