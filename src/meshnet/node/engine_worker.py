"""The engine worker process: loads a node's layer range and runs the engine's calls for the node.

Started by :class:`~meshnet.node.worker_supervisor.WorkerSupervisor` as ``python -m
meshnet.node.engine_worker FD`` with one end of a socket pair as file descriptor ``FD``; speaks
:mod:`meshnet.node.worker_wire` over it. The first message is LOAD (the pickled ``(NodeConfig,
generation)``); the worker answers READY with a :class:`~meshnet.node.engine_loader.LoadedEngine`, or
LOAD_FAILED with the reason, then serves CALLs until the pipe closes. A step goes from the reading
thread straight into the engine's scheduler, whose thread sends a small result itself (a decode's) and
queues a large one for the reply thread, so concurrent steps meet in the scheduler and share
iterations, as they do in one process, without a thread each; other calls (and a step that would have to wait for its session's previous one) run on
pool threads. PINGs are answered by the reading thread itself, so a worker answers them as long as its
Python runs at all. Opens no network socket. Dies with its node (Linux: the parent-death signal).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

from meshnet.node import worker_wire as ww
from meshnet.node.engine_loader import load_engine, load_failure, pin_to_cpu
from meshnet.supervisor import CHILD_LOG_FORMAT, die_with_parent

log = logging.getLogger("meshnet.worker")

# Hidden states up to this size (bytes) are sent from the scheduler's thread as soon as its step is done:
# a decode step's [1, n_embd] f32 (2.3 KB for SmolLM2, 16 KB at n_embd 4096), a few rows of a batch.
INLINE_REPLY_BYTES = 64 << 10

# The calls a node may make: the ShardEngine interface less load (done once, by LOAD).
CALLS = frozenset({"prefill", "decode", "cancel", "release", "release_superseded", "release_idle", "session_ids",
                   "health", "metrics", "device_free_bytes"})


def serve(sock: socket.socket) -> int:
    """Load, then answer calls until the node closes the pipe. Returns the exit status (0, or 3 when
    the load failed)."""
    lock = threading.Lock()
    kind, call_id, meta, payload = ww.receive(sock)
    if kind is not ww.Kind.LOAD:
        raise RuntimeError(f"engine worker: expected LOAD first, got {kind.name}")
    cfg, generation = ww.decode(meta, payload)
    if cfg.cpu is not None:
        pin_to_cpu(cfg.cpu)  # before loading, so the engine's threads start pinned
    try:
        engine, info = load_engine(cfg, generation)
    except Exception as e:  # noqa: BLE001 - whatever stops the load, the node reports it in one line
        ww.send(sock, lock, ww.Kind.LOAD_FAILED, call_id, *ww.encode(load_failure(e, cfg)))
        return 3
    ww.send(sock, lock, ww.Kind.READY, call_id, *ww.encode(info))
    # Control calls, and steps waiting for their session's previous step, each hold a thread: room for
    # the node's limit of concurrent calls, so a control call never queues behind steps.
    pool = ThreadPoolExecutor(max_workers=2 * (cfg.max_sessions + 8), thread_name_prefix="engine-call")

    def reply(call_id: int, method: str, out) -> None:
        """Answer a call with ``out``: its result, or the exception the engine raised."""
        if isinstance(out, BaseException):
            log.error("engine call %s failed", method, exc_info=out)
            kind, parts = ww.Kind.RAISED, ww.encode(f"{type(out).__name__}: {out}")
        else:
            kind, parts = ww.Kind.REPLY, ww.encode(out)
        try:
            ww.send(sock, lock, kind, call_id, *parts)
        except OSError:
            pass  # the node is gone; the reading loop ends too

    def run(call_id: int, method: str, args: tuple) -> None:
        try:
            if method not in CALLS:
                raise AttributeError(f"engine worker has no call {method!r}")
            out = getattr(engine, method)(*args)
        except Exception as e:  # noqa: BLE001 - the node reports it as the engine's failure
            out = e
        reply(call_id, method, out)

    step_async = getattr(engine, "step_async", None)  # None: every step runs on a pool thread

    def start_step(call_id: int, method: str, args: tuple) -> bool:
        """Start a step without a pool thread (see ShardEngine.step_async): the scheduler's thread queues
        its outcome for the reply thread. False: the step runs on a pool thread instead."""
        if method not in ("prefill", "decode") or step_async is None:
            return False
        try:
            return step_async(args[0], method == "decode", lambda out: finished(call_id, method, out))
        except Exception as e:  # noqa: BLE001 - refused before it started, as run() reports it
            reply(call_id, method, e)
            return True

    # A step's reply leaves from the scheduler's thread when it is small (a decode's hidden states): waking
    # a reply thread for it costs more than sending it. Larger ones (a prefill's hidden states, up to
    # many MB) are encoded and sent on a thread of their own, so that the next iteration's compute
    # overlaps them.
    replies: queue.SimpleQueue = queue.SimpleQueue()

    def finished(call_id: int, method: str, out) -> None:
        hidden = getattr(out, "hidden", None)
        if hidden is None or len(hidden.data) <= INLINE_REPLY_BYTES:
            reply(call_id, method, out)
        else:
            replies.put((call_id, method, out))

    def send_replies() -> None:
        while True:
            reply(*replies.get())

    threading.Thread(target=send_replies, name="engine-reply", daemon=True).start()
    try:
        while True:
            kind, call_id, meta, payload = ww.receive(sock)
            if kind is ww.Kind.PING:
                ww.send(sock, lock, ww.Kind.PONG, call_id)
            elif kind is ww.Kind.CALL:
                method, args = ww.decode_call(meta, payload)
                if not start_step(call_id, method, args):
                    pool.submit(run, call_id, method, args)
    except (EOFError, OSError):
        return 0  # the node closed the pipe: it is stopping or gave up on this worker


def main(argv: list[str]) -> int:
    die_with_parent(signal.SIGKILL)  # the node died: so does its engine (elsewhere the closed pipe ends it)
    logging.basicConfig(level=logging.INFO, format=CHILD_LOG_FORMAT, stream=sys.stderr)
    sock = socket.socket(fileno=int(argv[0]))
    # The node's SIGINT (Ctrl-C in its terminal) and SIGTERM (sent to its process group, as `timeout` and
    # service managers do) reach this process too; the node decides: it drains, then closes the pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    status = serve(sock)
    os._exit(status)  # skip interpreter teardown: pool threads may be mid-step in C


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
