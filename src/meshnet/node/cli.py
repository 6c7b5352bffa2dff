"""``meshnet node``'s command line: its flags, ``--fetch``, and the process's life around a
:class:`~meshnet.node.runner.Node` (signals, the ready line, draining on SIGTERM).

Prints ``MESHNET_NODE_READY node_id=... address=HOST:PORT`` on stdout once serving and registered (or,
with the tracker unreachable, after :data:`READY_WAIT_S` of trying: it serves and keeps trying), so a
parent process (``meshnet up``, tests) can learn a port chosen by the OS; the log (stderr) names its gRPC
and data-plane addresses. A node the tracker refuses for good (wrong key or protocol, or an id that a live
node at another address holds) exits with status 1 and the tracker's message on stderr, without the ready
line; so does a node whose engine worker keeps dying (a crash loop), after deregistering.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time

from meshnet.arg_types import (TRACKER_HELP, advertised_address, count, listen_host, load_setting, model_ref, node_id,
                               port_number, positive_seconds, seconds, thread_count, tracker_address, unresolved_host)
from meshnet.contract import LayerRange
from meshnet.load_spec import NO_HUGE_PAGES_HELP, PREFIX_CACHE_HELP
from meshnet.node.config import NodeConfig
from meshnet.node.engine_loader import pin_to_cpu
from meshnet.node.runner import Node
from meshnet.proto import meshnet_pb2_grpc as pb_grpc
from meshnet.secret_args import add_join_token_arg
from meshnet.supervisor import CHILD_LOG_FORMAT, announce, follow_supervisor, on_stop_signals, wait_for_stop
from meshnet.wire.addresses import (WILDCARD_HOSTS, dialable_host, is_loopback_address, is_loopback_host,
                                    on_another_machine)
from meshnet.wire.call_problems import tracker_refusal
from meshnet.wire.security import TlsConfig, open_channel, server_ssl_context

log = logging.getLogger("meshnet.node")

# How long the ready line waits for the tracker to accept the node's registration, seconds: a refusal
# then comes without it; a tracker that does not answer by then is still being tried. Once this many tries
# found no tracker at all (nothing listens there: no refusal can come), it is not waited for.
READY_WAIT_S = 5.0
READY_UNREACHABLE_TRIES = 2


def add_node_parser(sub) -> None:
    p = sub.add_parser("node", help="serve a layer range of a model and join a tracker")
    p.add_argument("--tracker", type=tracker_address, default=None, help=TRACKER_HELP)
    source = p.add_mutually_exclusive_group()  # a file here, or the tensors fetched from peers: never both
    source.add_argument("--model", default="smollm2", help="GGUF path or bundled name")
    p.add_argument("--layers", default=None, help="half-open range START:END, e.g. 0:15")
    source.add_argument("--fetch", type=model_ref, default=None, metavar="MODEL",
                   help="no model file here: fetch only the tensors of --layers (a model id, general.name or "
                        "bundled name the tracker knows) from nodes serving it into a range-only GGUF in "
                        "--models-dir, then serve it")
    p.add_argument("--models-dir", default=None,
                   help="where --fetch writes (and resumes) range-only files; default $MESHNET_CACHE_DIR/models "
                        "(~/.cache/meshnet/models)")
    p.add_argument("--host", type=listen_host, default="127.0.0.1", help="address to listen on (default %(default)s; 0.0.0.0 = every "
                                                        "interface)")
    p.add_argument("--port", type=port_number, default=0, help="gRPC port (default 0 = any free port)")
    p.add_argument("--advertise", type=advertised_address, default=None,
                   help="address others dial (default HOST:PORT; with HOST 0.0.0.0 or ::, this machine's "
                        "address on the way to the tracker)")
    p.add_argument("--node-id", type=node_id, default=None,
                   help="id to register under (default: derived from the identity's public key); the tracker "
                        "binds it to the first key that registers it")
    p.add_argument("--identity", default=None, metavar="PATH",
                   help="Ed25519 key file, created (mode 0600) on first start; default with --node-id "
                        "$XDG_CONFIG_HOME/meshnet/node-<node-id>.key (~/.config/meshnet/...), without it a fresh "
                        "key for this process (a new id each start)")
    p.add_argument("--engine", choices=["ggml", "fake"], default="ggml")
    p.add_argument("--fault", default="", metavar="SPEC",
                   help="with --engine fake, for tests: faults to inject, e.g. crash=segfault,after=5 (crash=raise|"
                        "segfault|abort|exit|sigkill|hang, after=N calls, delay=S, workers=K: the first K engine "
                        "workers get them, 0 = all; default 1)")
    p.add_argument("--in-process-engine", action="store_true",
                   help="run the engine in the node process instead of a supervised worker process (an engine "
                        "crash then takes the node down)")
    p.add_argument("--worker-restarts", type=count, default=5, metavar="N",
                   help="engine worker deaths in a row, each soon after its start, that are restarted (with "
                        "backoff) before the node deregisters and exits (default %(default)s)")
    p.add_argument("--worker-hang-timeout", type=positive_seconds, default=5.0, metavar="S",
                   help="seconds an engine worker may leave a ping unanswered before it is killed and restarted "
                        "(default %(default)g)")
    p.add_argument("--backend", choices=["cpu", "cuda", "rocm", "vulkan", "metal"], default="cpu",
                   help="where the ggml engine computes; anything but cpu must be certified here first "
                        "(meshnet backends --certify)")
    p.add_argument("--device", type=int, default=0, metavar="N",
                   help="with an accelerator --backend: which of its devices, in ggml's order (default 0)")
    p.add_argument("--threads", type=thread_count, default=2, help="CPU threads of the engine (default %(default)s)")
    p.add_argument("--cpu", type=int, default=None, help="pin the node to this CPU (e.g. 0)")
    p.add_argument("--n-ctx", type=load_setting("n_ctx"), default=0,
                   help="tokens one session may hold (default 0 = the model's, capped at 4096)")
    p.add_argument("--max-sessions", type=load_setting("max_sessions"), default=16, help="sessions held at once (default %(default)s)")
    p.add_argument("--kv-tokens", type=load_setting("kv_tokens"), default=0,
                   help="KV cells sessions may reserve at once (0 = half the memory available)")
    p.add_argument("--no-repack", dest="repack", action="store_false",
                   help="keep every weight as stored (by default mat-mul weights of the types whose repacked kernels "
                        "give each row the bits it gets alone on this CPU take ggml's repacked CPU layout, as "
                        "llama.cpp's do: Q4_0 and IQ4_NL matrices, Q4_0 / IQ4_NL / Q4_K / MXFP4 experts, and Q4_K "
                        "matrices as two row halves)")
    p.add_argument("--no-huge-pages", dest="huge_pages", action="store_false", help=NO_HUGE_PAGES_HELP)
    p.add_argument("--prefix-cache", type=load_setting("prefix_cache"), default=4,
                   help=PREFIX_CACHE_HELP)
    p.add_argument("--decode-groups", type=load_setting("decode_groups"), default=0,
                   help="groups the sessions' decode steps are split into, taking turns so that every stage "
                        "of a pipeline computes at once (0 = one per stage, from the range's share of the model's cost; "
                        "1 = all together)")
    p.add_argument("--idle-timeout", type=positive_seconds, default=300.0,
                   help="seconds before an unused session is freed (> 0; default %(default)g)")
    p.add_argument("--drain-timeout", type=seconds, default=30.0,
                   help="on SIGTERM, seconds the open sessions may take to finish before the node exits "
                        "(default %(default)g)")
    # A data port beside --no-data-plane was silently ignored: argparse refuses the two together.
    data_plane = p.add_mutually_exclusive_group()
    data_plane.add_argument("--data-port", type=port_number, default=0,
                            help="TCP port of the step data plane (default 0 = any free port)")
    data_plane.add_argument("--no-data-plane", action="store_true", help="serve steps over gRPC only")
    p.add_argument("--relay", action="store_true",
                   help="open no port: keep one outbound connection to the tracker (--tracker) and take all "
                        "traffic over it (for nodes behind NAT or a firewall; each hop costs more)")
    add_join_token_arg(p)
    p.add_argument("--tls-cert", default=None, help="serve TLS with this PEM certificate (with --tls-key)")
    p.add_argument("--tls-key", default=None, help="the PEM private key of --tls-cert")
    p.add_argument("--tls-ca", default=None,
                   help="CA/cert to verify a TLS tracker and the next node a step is forwarded to")
    p.set_defaults(func=run_node)


def _fetch_layers(args: argparse.Namespace) -> str:
    """``--fetch``: the path of the range-only file for ``--layers``, fetched (or resumed) first.
    Raises ValueError (FetchError) naming what is missing or which tensor did not verify."""
    from meshnet.client.manifest_source import models_dir
    from meshnet.node.fetch import fetch_from_tracker

    if not args.tracker or not args.layers:
        raise ValueError("--fetch needs --tracker (which knows the model) and --layers (what to fetch)")
    tracker = pb_grpc.TrackerStub(open_channel(args.tracker, args.join_token, args.tls_ca))
    result = fetch_from_tracker(tracker, args.fetch, LayerRange.parse(args.layers), args.models_dir or models_dir(),
                                lambda address: open_channel(address, args.join_token, args.tls_ca))
    log.info("layers %s of model %s: %s (%d of %d tensor bytes fetched now)", args.layers, result.model_id,
             result.path, result.bytes_moved, result.range_bytes)
    print(f"MESHNET_FETCHED path={result.path} bytes_moved={result.bytes_moved} range_bytes={result.range_bytes}",
          flush=True)
    return str(result.path)


def run_node(args: argparse.Namespace) -> int:
    if not follow_supervisor():  # started by `meshnet up`, which is gone already
        print("error: the meshnet up that started this node is gone", file=sys.stderr)
        return 1
    if args.port and args.port == args.data_port and not args.relay:
        # gRPC took the port first and the data plane then blamed it as taken, after the model had loaded.
        print(f"error: --port and --data-port are both {args.port}: gRPC and the data plane each need a port of "
              "their own", file=sys.stderr)
        return 2
    backend = getattr(args, "backend", "cpu")
    device = getattr(args, "device", 0)
    if device < 0:
        print(f"error: --device must be 0 or more, got {device}", file=sys.stderr)
        return 2
    if device and backend == "cpu":  # the CPU lane has one device: a GPU index here would be ignored
        print(f"error: --device {device} picks one of an accelerator's devices; give --backend too (cuda, rocm, "
              "vulkan, metal)", file=sys.stderr)
        return 2
    if backend != "cpu":
        # Refuse before loading anything: an accelerator that has not proved itself here stays dark.
        from meshnet.backends.errors import BackendUnavailable
        from meshnet.backends.lanes import require_certified

        try:
            require_certified(backend, device)
        except BackendUnavailable as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    cpu = getattr(args, "cpu", None)
    if cpu is not None:
        pin_to_cpu(cpu)  # before loading, so the engine's threads start pinned
    logging.basicConfig(level=logging.INFO, format=CHILD_LOG_FORMAT, stream=sys.stderr)
    if args.tls_ca and args.tls_cert is None and not args.relay:
        # The mesh speaks TLS (its tracker does): clients and the nodes before this one dial it over TLS.
        print("error: --tls-ca without --tls-cert: in a mesh that speaks TLS this node must too (give it "
              "--tls-cert and --tls-key), or reach it only through the tracker (--relay)", file=sys.stderr)
        return 2
    if (args.tls_cert is None) != (args.tls_key is None):
        print("error: --tls-cert and --tls-key go together", file=sys.stderr)
        return 2
    tls = TlsConfig(args.tls_cert, args.tls_key) if args.tls_cert else None
    if tls is not None:
        try:  # before the model loads: unreadable, mismatched or expired files
            server_ssl_context(tls)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if (args.tracker and not args.relay and not args.advertise and is_loopback_host(args.host)
            and not is_loopback_address(args.tracker)):
        if on_another_machine(args.tracker):
            # The tracker refuses it (Register): said before the model loads, or its layers are fetched.
            print(f"error: --host {args.host}: this node would listen on loopback only, and its tracker "
                  f"({args.tracker}) is on another machine, which refuses a node only this machine can dial; pass "
                  "--host 0.0.0.0 (or this machine's address), with --advertise HOST:PORT where others reach it by "
                  "another address, or --relay", file=sys.stderr)
            return 2
        # A tracker at one of this machine's addresses (or named by a host name, which may be one) takes such
        # a node, and every client elsewhere that the route sends to it is refused its connection.
        print(f"warning: --host {args.host}: this node listens on loopback only, while its tracker "
              f"({args.tracker}) is reached over the network: clients and nodes on other machines cannot reach "
              f"it; pass --host 0.0.0.0 (or this machine's address), with --advertise HOST:PORT where others "
              f"reach it by another address",
              file=sys.stderr, flush=True)
    model = args.model
    if getattr(args, "fetch", None):
        try:
            model = _fetch_layers(args)
        except ValueError as e:  # FetchError too: nothing registered, the part file kept for a resume
            print(f"error: {e}", file=sys.stderr)
            return 2
        except OSError as e:  # writing the range file: the disk full, the folder gone meanwhile
            print(f"error: fetching layers {args.layers}: {e.strerror or e} ({e.filename or ''})", file=sys.stderr)
            return 1
    cfg = NodeConfig(model=model, layers=LayerRange.parse(args.layers) if args.layers else None,
                     tracker=args.tracker, host=args.host, port=args.port, advertise=args.advertise,
                     node_id=args.node_id, engine=args.engine, threads=args.threads, n_ctx=args.n_ctx,
                     max_sessions=args.max_sessions, kv_tokens=args.kv_tokens,
                     prefix_cache=args.prefix_cache, repack=args.repack, huge_pages=args.huge_pages, decode_groups=args.decode_groups, idle_timeout_s=args.idle_timeout,
                     drain_timeout_s=args.drain_timeout, join_token=args.join_token, tls=tls, tls_ca=args.tls_ca,
                     data_plane=not args.no_data_plane, data_port=args.data_port,
                     cpu=cpu, backend=backend, device_index=device, identity=getattr(args, "identity", None),
                     relay=getattr(args, "relay", False), fault=args.fault,
                     in_process_engine=args.in_process_engine, worker_restarts=args.worker_restarts,
                     worker_hang_timeout_s=args.worker_hang_timeout)
    if cfg.fault and cfg.engine != "fake":
        print(f"error: --fault needs --engine fake (got --engine {cfg.engine})", file=sys.stderr)
        return 2
    if cfg.relay and not cfg.tracker:
        print("error: --relay needs --tracker (a relayed node is reached only through its tracker)", file=sys.stderr)
        return 2
    if cfg.relay and (given := next((f for f, v in (("--port", args.port), ("--data-port", args.data_port),
                                                    ("--advertise", args.advertise)) if v), None)):
        print(f"error: {given} does not apply with --relay: a relayed node opens no port (everything reaches it "
              "through the tracker)", file=sys.stderr)
        return 2
    if cfg.advertise and (why := unresolved_host(cfg.advertise)):
        print(f"warning: --advertise {cfg.advertise}: the name does not resolve on this machine ({why}); clients "
              "and nodes that cannot resolve it either will fail to reach this node", file=sys.stderr, flush=True)
    if warning := unreachable_wildcard(cfg):
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    if warning := loopback_behind_advertise(cfg):
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    if not cfg.tracker:  # fine for a test or a peer to fetch from, but no client will find it
        print("warning: no --tracker: this node registers nowhere, so no route or client finds it; give it "
              "--tracker HOST:PORT to join a mesh", file=sys.stderr, flush=True)
    refused = tracker_refusal(cfg.tracker, args.join_token, args.tls_ca) if cfg.tracker else None
    if refused:
        print(f"error: --tracker {cfg.tracker}: {refused}", file=sys.stderr)
        return 1
    try:
        node = Node(cfg)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    done = threading.Event()
    on_stop_signals(done.set)
    node.start()
    if not _registered_or_trying(node):
        wait_for_stop(done)  # the refusal has signalled this process: drain and exit 1
        node.stop(drain=True)
        return 1
    if cfg.relay:
        # Ready means reachable: wait (bounded) until the tracker has attached the relay stream.
        if not node.relay_attached.wait(30):
            log.warning("relay stream not attached yet; the node stays out of routes until it is")
    layers = node.loaded.caps.artifact.layers
    announce(f"MESHNET_NODE_READY node_id={node.node_id} address={node.address} layers={layers}")
    dev = node.loaded.device or {}
    # Both addresses: clients dial the data plane for steps, so a firewall must pass it too.
    device = dev.get("description") or dev.get("name")  # the fake engine has none
    log.info("node %s serving layers %s: gRPC %s, data plane %s; %s%s (%.1f tok/s decode probe)",
             node.node_id, layers, node.address, node.data_address or "off (steps over gRPC)",
             node.loaded.caps.backend, f" on {device}" if device else "", node.decode_tokens_per_s)
    wait_for_stop(done)
    log.info("draining node %s (a second signal changes nothing; SIGKILL stops it at once)", node.node_id)
    node.stop(drain=True)
    log.info("node %s stopped", node.node_id)
    return 1 if node.failure else 0


def unreachable_wildcard(cfg: NodeConfig) -> str | None:
    """Why a node bound to every interface would still register an address only its machine can dial, or
    None: its tracker is on this machine (dialled by loopback) and the machine has no default route, so no
    address others reach it by is known (`meshnet up --host 0.0.0.0` refuses the same)."""
    if cfg.host not in WILDCARD_HOSTS or not cfg.tracker or cfg.advertise or cfg.relay:
        return None
    if not is_loopback_host(registered := dialable_host(cfg.host, cfg.tracker)):
        return None
    return (f"--host {cfg.host}: this node registers {registered}, which only this machine can dial (its tracker "
            f"is dialled by loopback and this machine has no default route to tell its address by): clients and "
            f"nodes on other machines cannot reach it; pass --advertise HOST:PORT with its address on their network")


def loopback_behind_advertise(cfg: NodeConfig) -> str | None:
    """Why a node listening on loopback only but advertising another address would be refused every
    connection, or None. The tracker's and the node's own hints name `--advertise HOST:PORT` beside
    `--host 0.0.0.0`; taken alone it registered an address where nothing listened, without a word, and every
    client was refused there ("no node serves layers ..."). Only a proxy or tunnel on the advertised address
    that forwards to this loopback port makes it work, so this warns rather than refuses."""
    if not cfg.advertise or cfg.relay or not is_loopback_host(cfg.host):
        return None
    if is_loopback_address(cfg.advertise):
        return None
    advertised = cfg.advertise.rpartition(":")[0].strip("[]")
    return (f"--advertise {cfg.advertise} with --host {cfg.host}: this node listens on loopback only, so nothing "
            f"answers at {advertised} unless a proxy or tunnel there forwards to it; pass --host 0.0.0.0 (or "
            f"this machine's address) as well")


def _registered_or_trying(node: Node) -> bool:
    """Wait (at most :data:`READY_WAIT_S`, or while the tracker holds the node's id for an entry that may
    expire, or until :data:`READY_UNREACHABLE_TRIES` tries found no tracker) until the tracker has the node;
    False when it refused it."""
    membership = node.membership
    deadline = time.monotonic() + READY_WAIT_S
    while membership is not None and not membership.registered.wait(0.05):
        if membership.refusal is not None:
            return False
        gone = membership.unreachable_tries >= READY_UNREACHABLE_TRIES
        if (gone or time.monotonic() >= deadline) and not membership.waiting_for_id:
            log.warning("not registered with the tracker yet; serving and still trying")
            break
    return membership is None or membership.refusal is None

