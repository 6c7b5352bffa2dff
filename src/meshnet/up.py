"""``meshnet up``: a whole mesh on this machine in one command — a tracker in this process and one
``meshnet node`` process per layer range on loopback — kept serving until Ctrl-C or SIGTERM.

A node process that exits is restarted with exponential backoff (:mod:`meshnet.restart_policy`:
0.5 s doubling to 10 s, reset after 30 s of running), each exit and restart logged on stderr; the
tracker and the API keep serving meanwhile (a route through a spare attached from elsewhere, if any).
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import sys
import threading
import time

import grpc
from tqdm import tqdm

from meshnet.arg_types import (TRACKER_PORT, heartbeat_seconds, listen_host, load_setting, port_number, positive_seconds, seconds,
                               thread_count)
from meshnet.load_spec import NO_HUGE_PAGES_HELP, PREFIX_CACHE_HELP
from meshnet.dashboard.cli import add_dashboard_args, dashboard_from_args, dashboard_port_problem, dashboard_port_taken
from meshnet.proto import meshnet_pb2 as pb
from meshnet.speculative import add_speculation_args, mtp_problem, speculation_from_args
from meshnet.proto import meshnet_pb2_grpc as pb_grpc
from meshnet.secret_args import add_api_key_arg, add_join_token_arg
from meshnet.supervisor import Supervisor, announce, on_stop_signals, wait_for_stop
from meshnet.wire.addresses import WILDCARD_HOSTS, bind_problem, format_address, this_machine_address
from meshnet.wire.call_problems import tracker_hint
from meshnet.wire.security import JOIN_TOKEN_ENV, open_channel

# Seconds a node gets past its drain to stop (deregister, its engine worker, its servers) before SIGKILL.
STOP_MARGIN_S = 5.0


def add_up_parser(sub) -> None:
    p = sub.add_parser("up", help="start a tracker and N local nodes for a model; serve until Ctrl-C")
    p.add_argument("--model", default="smollm2", help="GGUF path or bundled name (default %(default)s)")
    p.add_argument("--stages", type=int, default=3, help="node processes, one layer range each")
    p.add_argument("--host", type=listen_host, default="127.0.0.1",
                   help="address the tracker, nodes and API listen on (default %(default)s; 0.0.0.0 = every "
                        "interface, and the others are told this machine's address)")
    p.add_argument("--port", type=port_number, default=TRACKER_PORT, help="tracker port (default %(default)s)")
    p.add_argument("--node-ports", type=port_number, default=0, metavar="FIRST",
                   help="node i listens on FIRST + 2i (gRPC) and FIRST + 2i + 1 (its step data plane), for a "
                        "firewall or a router to let through; 0 = any free ports (default)")
    p.add_argument("--threads", type=thread_count, default=1, help="CPU threads per node (default %(default)s: its nodes share this machine)")
    p.add_argument("--n-ctx", type=load_setting("n_ctx"), default=0, help="context length per session (0 = model's, capped at 4096)")
    p.add_argument("--max-sessions", type=load_setting("max_sessions"), default=16,
                   help="sessions each node holds (default %(default)s); also the generations its API runs at once, "
                        "more waiting their turn")
    p.add_argument("--kv-tokens", type=load_setting("kv_tokens"), default=0,
                   help="KV cells each node's sessions may reserve at once (0 = half the memory available)")
    p.add_argument("--prefix-cache", type=load_setting("prefix_cache"), default=4,
                   help=PREFIX_CACHE_HELP)
    p.add_argument("--decode-groups", type=load_setting("decode_groups"), default=0,
                   help="groups each node splits its sessions' decodes into, taking turns so that every stage "
                        "computes at once (0 = one per stage, 1 = all together)")
    p.add_argument("--no-huge-pages", dest="huge_pages", action="store_false", help=NO_HUGE_PAGES_HELP)
    p.add_argument("--heartbeat", type=heartbeat_seconds, default=1.0,
                   help="node heartbeat interval, seconds (default %(default)s)")
    p.add_argument("--client-orchestrated", action="store_true",
                   help="the API's steps: " + "every step through the client, hop by hop (default: nodes forward hidden states to the next node themselves where the route allows)")
    add_join_token_arg(p)
    add_api_key_arg(p)
    p.add_argument("--timeout", type=positive_seconds, default=300.0,
                   help="seconds to wait for a complete route (default %(default)g)")
    p.add_argument("--drain-timeout", type=seconds, default=10.0,
                   help="at Ctrl-C or SIGTERM, seconds other clients' open sessions may take to finish before "
                        "the nodes stop (default %(default)g; a second Ctrl-C stops them at once)")
    p.add_argument("--ledger", default=None, metavar="URL",
                   help="the tracker's ledger, as for meshnet tracker --ledger (sqlite:///PATH, postgresql://...); "
                        "default in memory: its balances end with this mesh")
    p.add_argument("--api-port", type=int, default=8000,
                   help="serve the OpenAI-compatible API on this port (default %(default)s; 0 = any free port, -1 = no API)")
    add_dashboard_args(p)
    add_speculation_args(p)  # the API's default; a request may say otherwise
    p.set_defaults(func=run_up)


def wait_for_route(tracker: str, timeout_s: float, join_token: str | None = None, expected_hops: int = 0,
                   progress: bool = True, stop: threading.Event | None = None,
                   tls_ca: str | None = None) -> pb.Route:
    """Poll the tracker until it has a complete route (of ``expected_hops`` hops if > 0); ``tls_ca``
    verifies a tracker that speaks TLS.

    Raises:
        TimeoutError: naming the tracker's last reason (e.g. the missing layers).
    """
    stub = pb_grpc.TrackerStub(open_channel(tracker, join_token, tls_ca))
    deadline = time.monotonic() + timeout_s
    reason = "tracker not reachable"
    bar = tqdm(total=expected_hops or None, desc="waiting for a complete route", unit="node",
               file=sys.stderr, disable=not progress, leave=False)
    try:
        while time.monotonic() < deadline:
            if stop is not None and stop.is_set():
                raise KeyboardInterrupt
            try:
                nodes = stub.ListNodes(pb.Empty(), timeout=2).nodes
                bar.n = len(nodes)
                bar.refresh()
                route = stub.GetRoute(pb.RouteRequest(), timeout=2)
                if not expected_hops or len(route.hops) >= expected_hops:
                    return route
            except grpc.RpcError as e:
                reason = (e.details() or e.code().name) + tracker_hint(e, tls_ca)
            time.sleep(0.2)
    finally:
        bar.close()
    raise TimeoutError(f"no complete route after {timeout_s:g} s: {reason}")


class _Refused(Exception):
    """A setting the mesh cannot start with, found after its nodes started (the message says which)."""


def _bind_error(host: str, port: int) -> OSError | None:
    """Why a server could not listen on ``host:port`` now (taken, or not an address here), or None."""
    from meshnet.api.server import bind_http_socket

    try:
        bind_http_socket(host, port).close()
    except OSError as e:
        return e
    return None


def _tracker_port_problem(host: str, port: int) -> str | None:
    """Why the tracker could not listen on ``host:port`` when it is taken, or None. Checked before the API's
    port: a `meshnet up` already running on the same ports was told to pass another --api-port."""
    e = _bind_error(host, port)
    if e is None or e.errno != errno.EADDRINUSE:
        return None  # free, or not an address here: start_tracker says so
    return (f"the tracker cannot listen on {format_address(host, port)} ({e.strerror}). Is another tracker or "
            "`meshnet up` running there? Pass another --port.")


def _api_port_problem(host: str, port: int) -> str | None:
    """Why the API could not listen on ``host:port`` (taken, or not an address here), or None: checked
    before the nodes load, so that a taken port fails at once, as a taken tracker port does."""
    if (e := _bind_error(host, port)) is None:
        return None
    return (f"the API cannot listen on {format_address(host, port)} ({e.strerror or e}); pass another --api-port "
            "(0 = any free port, -1 = no API) or --host")


def try_command(tracker: str, model: str, join_token: bool) -> str:
    """The ``meshnet generate`` line the ready message suggests: it names the model unless it is
    ``meshnet generate``'s own default (which would otherwise look for a route of smollm2), and a
    placeholder for the join token (the secret stays out of logs)."""
    import shlex

    from meshnet.model.bundled import DEFAULT_MODEL

    model_flag = "" if model == DEFAULT_MODEL else f" --model {shlex.quote(model)}"
    token = " --join-token YOUR_TOKEN" if join_token else ""
    return f'meshnet generate --tracker {tracker}{model_flag}{token} "Hello"'


def node_ports(first: int, n_nodes: int) -> list[tuple[int, int]]:
    """(gRPC port, data-plane port) of each of ``n_nodes`` nodes from ``--node-ports FIRST``: node i
    takes ``FIRST + 2i`` and ``FIRST + 2i + 1``; all ``(0, 0)`` (any free ports) when ``first`` is 0.

    Raises:
        ValueError: the last port would pass 65535.
    """
    if not first:
        return [(0, 0)] * n_nodes
    if first + 2 * n_nodes - 1 > 65535:
        raise ValueError(f"--node-ports {first} leaves no room for {n_nodes} nodes' {2 * n_nodes} ports "
                         f"(the last would be {first + 2 * n_nodes - 1}, past 65535)")
    return [(first + 2 * i, first + 2 * i + 1) for i in range(n_nodes)]


def _node_ports_problem(host: str, ports: list[tuple[int, int]]) -> str | None:
    """Why a node could not listen on one of ``ports`` on ``host`` (taken), or None: a node started on a
    taken port would exit, be restarted and exit again without end."""
    for i, pair in enumerate(ports):
        for port in pair:
            if port and (why := bind_problem(host, port)) is not None:
                return (f"node {i} cannot listen on {format_address(host, port)} ({why}); pass another "
                        "--node-ports (0 = any free ports)")
    return None


def run_up(args: argparse.Namespace) -> int:
    from meshnet.local_mesh import plan_ranges
    from meshnet.model.bundled import resolve_model
    from meshnet.tracker.registry import Registry
    from meshnet.tracker.server import start_tracker

    # The warnings of its API's client and tracker (a failover, a node gone) read as its own lines do.
    logging.basicConfig(level=logging.WARNING, format="[meshnet up] %(message)s")
    problem = dashboard_port_problem(args.dashboard_port)
    if not -1 <= args.api_port <= 65535:
        problem = f"--api-port must be -1 (no API) or in 0..65535, got {args.api_port}"
    mine = [(flag, port) for flag, port in (("--port", args.port), ("--api-port", args.api_port),
                                            ("--dashboard-port", args.dashboard_port)) if port > 0]
    same = next(((a, b, p) for i, (a, p) in enumerate(mine) for b, q in mine[i + 1:] if p == q), None)
    if same is not None:  # each is free until one of them takes it, after every node has loaded
        problem = problem or f"{same[0]} and {same[1]} are both {same[2]}: the tracker, the API and the " \
                             "dashboard each need a port of their own"
    if not problem and args.port > 0:  # first: a second `meshnet up` on the same ports is named for what it is
        problem = _tracker_port_problem(args.host, args.port)
    if not problem and args.api_port > 0:
        problem = _api_port_problem(args.host, args.api_port)
    problem = problem or dashboard_port_taken(args)
    if not problem and args.host in WILDCARD_HOSTS and this_machine_address(args.host) in WILDCARD_HOSTS:
        # Its nodes would register 127.0.0.1 and its ready line name 0.0.0.0: nothing another machine can dial.
        problem = (f"--host {args.host}: this machine has no default route, so there is no address of it to give "
                   "other machines; pass --host with its address on the network they share")
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    path = str(resolve_model(args.model))
    ranges = plan_ranges(path, args.stages)
    ports = node_ports(args.node_ports, len(ranges))  # ValueError: exit status 2
    own = {port: flag for flag, port in (("--port", args.port), ("--api-port", args.api_port),
                                         ("--dashboard-port", args.dashboard_port)) if port > 0}
    clash = next(((i, port) for i, pair in enumerate(ports) for port in pair if port in own), None)
    if clash is not None:  # free now, the tracker, API or dashboard takes it before the node starts
        print(f"error: --node-ports {args.node_ports} gives node {clash[0]} port {clash[1]}, which "
              f"{own[clash[1]]} takes; pass another --node-ports", file=sys.stderr)
        return 2
    if problem := _node_ports_problem(args.host, ports):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.api_port < 0 and (args.speculative not in (None, "none") or args.draft_model or args.draft_tokens is not None):
        print("error: --speculative, --draft-model and --draft-tokens set the API's speculative decoding; with "
              "--api-port -1 there is no API (a client speculates with its own flags, e.g. meshnet generate "
              "--speculative ngram)", file=sys.stderr)
        return 2
    speculation = speculation_from_args(args, path) if args.api_port >= 0 else None  # ValueError: status 2
    registry = Registry(args.heartbeat)
    ledger = None
    if args.ledger:
        from meshnet.ledger.store import Ledger, LedgerError

        try:
            ledger = Ledger(args.ledger)
        except LedgerError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    try:
        server, port, service = start_tracker(args.host, args.port, join_token=args.join_token, registry=registry,
                                              ledger=ledger)
    except RuntimeError as e:  # the port is taken: another tracker, or an earlier `meshnet up` still running
        if ledger is not None:
            ledger.close()
        print(f"error: the tracker {str(e).rstrip('.')}. Is another tracker or `meshnet up` running there? "
              f"Pass another --port.", file=sys.stderr)
        return 2
    if ledger is not None:
        print(f"[meshnet up] ledger {ledger.display_url}", file=sys.stderr, flush=True)
    # Bound to every interface, the mesh is named (to its nodes, which register the address they reach
    # it by, and in the hints printed) by this machine's address that other machines can dial.
    tracker = format_address(this_machine_address(args.host), port)
    print(f"[meshnet up] tracker on {tracker}; starting {len(ranges)} nodes: "
          f"{', '.join(str(r) for r in ranges)}", file=sys.stderr, flush=True)
    # Up before the nodes: the map shows them arrive.
    dashboard = dashboard_from_args(service, args, "[meshnet up]")
    # The nodes take the mesh's token from here, the flag's included: an empty --join-token (no token) left
    # them $MESHNET_JOIN_TOKEN, and the API and tracker, without one, were refused by them.
    env = dict(os.environ, **{JOIN_TOKEN_ENV: args.join_token or ""})
    # Named nodes keep their ids (and keys) across the supervisor's restarts.
    names = [f"node-{i}-{r.start}-{r.end}" for i, r in enumerate(ranges)]
    children = [(name, [sys.executable, "-m", "meshnet.cli", "node", "--tracker", tracker, "--model", path,
                        "--layers", str(r), "--host", args.host, "--threads", str(args.threads), "--node-id", name,
                        "--n-ctx", str(args.n_ctx), "--max-sessions", str(args.max_sessions),
                        "--kv-tokens", str(args.kv_tokens), "--prefix-cache", str(args.prefix_cache),
                        "--decode-groups", str(args.decode_groups), "--drain-timeout", str(args.drain_timeout),
                        "--port", str(port),
                        "--data-port", str(data_port)] + ([] if args.huge_pages else ["--no-huge-pages"]))
                for name, r, (port, data_port) in zip(names, ranges, ports)]
    # A node that died leaves routing at once (not after three silent heartbeats), and its restart can
    # take its id back without being refused as a second claimant.
    stop = threading.Event()
    refused: list[str] = []

    def on_refused(name: str, why: str) -> None:
        refused.append(f"node {name} refused its settings: {why.removeprefix('error: ')}")
        stop.set()

    supervisor = Supervisor(children, env=env, on_exit=registry.deregister, on_refused=on_refused)
    # Handle SIGINT explicitly too: a shell starts background jobs with SIGINT ignored. Before the nodes start,
    # so that a signal while they start stops them the same way (one to a background `up` was ignored then).
    on_stop_signals(lambda: (supervisor.halt(), stop.set()), again=supervisor.hurry)
    code = 0
    api = None
    try:
        supervisor.start()
        route = wait_for_route(tracker, args.timeout, args.join_token, len(ranges), sys.stderr.isatty(), stop)
        print(f"[meshnet up] route ready (epoch {route.epoch}): "
              + " -> ".join(f"{h.node_id}@{h.address}" for h in route.hops), file=sys.stderr)
        api_url = ""
        if args.api_port >= 0:
            from meshnet.api.backend import mesh_backend
            from meshnet.api.server import open_api_warning, start_api_in_thread

            api_backend = mesh_backend(tracker, args.model, join_token=args.join_token,
                                       max_concurrency=args.max_sessions,
                                       forwarding=not args.client_orchestrated)
            api_backend.speculation = speculation
            api_backend.mtp_problem = mtp_problem(path, api_backend.model_name)  # names no server path
            try:
                api = (api_backend, *start_api_in_thread(api_backend, args.host, args.api_port,
                                                         api_key=args.api_key))
                api_url = f"http://{format_address(this_machine_address(args.host), api[1].config.port)}/v1"
                print(f"[meshnet up] OpenAI-compatible API on {api_url}"
                      + (" (API key required)" if args.api_key else ""), file=sys.stderr, flush=True)
                if warning := open_api_warning(args.host, api[1].config.port, args.api_key, "this mesh"):
                    print(f"[meshnet up] {warning}", file=sys.stderr, flush=True)
            except OSError as e:  # taken since the check at the start
                api_backend.close()
                raise _Refused(f"the API cannot listen on {format_address(args.host, args.api_port)} ({e}); pass "
                               "another --api-port (0 = any free port, -1 = no API)") from None
        announce(f"MESHNET_UP_READY tracker={tracker}" + (f" api={api_url}" if api_url else "")
                 + (f" dashboard={dashboard.url}" if dashboard else ""))
        print(f"[meshnet up] try: {try_command(tracker, args.model, bool(args.join_token))}   "
              "(Ctrl-C stops the mesh)", file=sys.stderr, flush=True)
        if dashboard:
            print(f"[meshnet up] watch it: {dashboard.url}", file=sys.stderr, flush=True)
        # The supervisor restarts nodes that exit; only a signal ends the mesh.
        wait_for_stop(stop)
    except KeyboardInterrupt:
        pass
    except TimeoutError as e:
        print(f"[meshnet up] {e}", file=sys.stderr)
        code = 1
    except _Refused as e:
        refused.append(str(e))
    finally:
        if refused:
            print(f"error: {refused[0]}", file=sys.stderr)
            code = 2
        if api is not None:
            from meshnet.api.server import stop_api

            api[0].stopping.set()  # its generations end with a 503 at their next token, as meshnet api's
            stop_api(api[1], api[2])
            api[0].close()
        held = open_sessions(registry, args.join_token)
        print("[meshnet up] stopping nodes" + (f" (sessions still open: {held}; up to {args.drain_timeout:g} s "
                                              "for them to finish, Ctrl-C again stops now)" if held else ""),
              file=sys.stderr, flush=True)
        # A node exits once drained; the margin covers its own stop after the drain.
        supervisor.stop(timeout_s=args.drain_timeout + STOP_MARGIN_S)
        if dashboard is not None:
            dashboard.stop()
        server.stop(grace=1).wait()
        if ledger is not None:
            ledger.close()
        print("[meshnet up] stopped", file=sys.stderr, flush=True)  # nothing of the mesh runs any more
    return code


def open_sessions(registry, join_token: str | None) -> int:
    """Other clients' sessions still open on the mesh (the API's, ended before, are not): the most any node
    holds, asked of each node (a session is open on every node of its route), or as of its last heartbeat
    where it does not answer at once. The heartbeats' figure alone still counted the API's own stream,
    released a moment before, and the routes handed out since."""
    def held(record) -> int:
        try:
            with open_channel(record.address, join_token) as channel:
                return pb_grpc.NodeStub(channel).Health(pb.Empty(), timeout=1.0).active_sessions
        except grpc.RpcError:
            return record.active_sessions

    return max((held(s.record) for s in registry.statuses() if not s.record.relayed), default=0)
