"""Keep a node's engine worker process running: start it, watch it, restart it when it dies or hangs.

The worker (:mod:`meshnet.node.engine_worker`) is a fresh interpreter started with one end of a Unix
socket pair. A worker that dies (segfault, abort, OOM kill, exit) closes the pipe: its in-flight calls
fail at once (EngineUnavailable) and it is started again after the backoff of
:mod:`meshnet.restart_policy`, reloading the range; sessions it held are gone (their steps answer
NOT_FOUND and the clients replay them). A worker that stops answering pings for ``hang_timeout_s``
while it still runs is killed (SIGKILL) and restarted the same way. After more than
``max_restarts`` quick deaths in a row (a crash loop), the supervisor stops restarting and calls
``on_give_up`` with the reason; the node then deregisters and exits non-zero.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
import time
from typing import Callable

from meshnet.node import worker_wire as ww
from meshnet.node.config import NodeConfig
from meshnet.node.engine_loader import LoadedEngine, load_subject
from meshnet.node.worker_channel import WorkerChannel
from meshnet.restart_policy import RestartPolicy, exit_reason, next_restart

log = logging.getLogger("meshnet.node")

# How long a worker may take to load its range before the start counts as failed (seconds).
LOAD_TIMEOUT_S = 300.0


class WorkerSupervisor:
    """One engine worker for ``cfg`` at a time. Thread-safe.

    Args:
        cfg: the node's configuration (the worker loads ``cfg``'s engine; ``cfg.worker_restarts`` and
            ``cfg.worker_hang_timeout_s`` bound restarts and hangs).
        policy: restart backoff.
        on_give_up: called once, from the watcher thread, with the reason, when the worker keeps dying.
        ping_interval_s: seconds between liveness pings.

    After :meth:`start`, ``info`` describes the loaded engine (of the first worker: a restart
    reloads the same range) and :meth:`channel` reaches the current worker.
    """

    def __init__(self, cfg: NodeConfig, policy: RestartPolicy = RestartPolicy(),
                 on_give_up: Callable[[str], None] | None = None, ping_interval_s: float = 0.5) -> None:
        self.cfg = cfg
        self.policy = policy
        self.on_give_up = on_give_up
        self.ping_interval_s = ping_interval_s
        self.info: LoadedEngine | None = None
        self.restarts = 0  # workers started after the first
        self.failure: str | None = None  # why the supervisor gave up, once it has
        self._generation = 0
        self._quick_exits = 0  # quick deaths in a row so far (restart_policy's count)
        self._proc: subprocess.Popen | None = None
        self._channel: WorkerChannel | None = None
        self._started = 0.0
        self._status = "engine worker starting"
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        """The current worker's process id (None between workers)."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    @property
    def status(self) -> str:
        """Empty while a worker serves, else what is happening instead (restarting and why, gave up)."""
        ch = self._channel
        if ch is not None and not ch.lost.is_set():
            return ""
        if self.failure is not None:
            return f"engine worker gave up: {self.failure}"
        return f"engine worker restarting ({ch.lost_reason})" if ch is not None else self._status

    def channel(self) -> WorkerChannel:
        """The serving worker's channel. Raises EngineUnavailable (with :attr:`status`) between workers."""
        ch = self._channel
        if ch is None or ch.lost.is_set():
            raise ww.EngineUnavailable(self.status)
        return ch

    def start(self) -> None:
        """Start the first worker, wait until it has loaded, and start watching it.

        Raises:
            ValueError: the worker could not load (the engine's message: bad model, range, fault spec).
        """
        self._launch()
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="engine-worker-watch")
        self._watcher.start()

    def stop(self) -> None:
        """Stop the worker (its sessions are gone) and restart nothing from now on."""
        self._stop.set()
        ch, proc = self._channel, self._proc
        if ch is not None:
            ch.close("the node is stopping")
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)

    # ---- internals ---------------------------------------------------------------------------
    def _launch(self) -> None:
        """Start a worker and wait for its READY. Raises ValueError (LOAD_FAILED, or it died while
        loading) or OSError (socket timeout)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # The worker's stdout goes to stderr: the node's stdout carries only its ready line.
        proc = subprocess.Popen([sys.executable, "-m", "meshnet.node.engine_worker", str(theirs.fileno())],
                                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=sys.stderr)
        theirs.close()
        self._proc = proc
        try:
            ours.settimeout(LOAD_TIMEOUT_S)
            ww.send(ours, threading.Lock(), ww.Kind.LOAD, 0, *ww.encode((self.cfg, self._generation)))
            kind, _, meta, payload = ww.receive(ours)
            ours.settimeout(None)
        except (EOFError, ConnectionError):  # it died while loading (a crash in native code, the OOM killer)
            ours.close()
            reason = self._exit_reason()
            proc.kill()
            raise ValueError(f"the engine worker {reason} while loading {load_subject(self.cfg)} "
                             f"(its messages are above)") from None
        except BaseException:
            ours.close()
            proc.kill()
            proc.wait(10)
            raise
        if kind is not ww.Kind.READY:
            ours.close()
            proc.wait(10)
            raise ValueError(ww.decode(meta, payload))
        if self.info is None:
            self.info = ww.decode(meta, payload)
        self._started = time.monotonic()
        self._channel = WorkerChannel(ours, explain=self._exit_reason)
        log.info("engine worker pid %d serving layers %s", proc.pid, self.info.caps.artifact.layers)

    def _exit_reason(self) -> str:
        proc = self._proc
        try:
            return exit_reason(proc.wait(2)) if proc is not None else ""
        except subprocess.TimeoutExpired:
            return "the pipe closed"

    def _watch(self) -> None:
        while not self._stop.is_set():
            ch = self._channel
            if not ch.lost.wait(self.ping_interval_s):
                if self._stop.is_set() or ch.ping(self.cfg.worker_hang_timeout_s) or ch.lost.is_set():
                    continue
                # Alive but not running Python (a native deadlock, a stopped process): kill it.
                reason = f"hung: no answer to a ping within {self.cfg.worker_hang_timeout_s:g} s, killed"
                self._proc.kill()
                ch.close(reason)
            if self._stop.is_set():
                return
            self._recover(ch.lost_reason)
            if self.failure is not None:
                return  # gave up: nothing left to watch

    def _recover(self, reason: str) -> None:
        """The worker is gone because ``reason``: restart it after the backoff, or give up."""
        ran_s = time.monotonic() - self._started
        quick = self._quick_exits
        pid = self._proc.pid
        self._proc.wait(10)
        while not self._stop.is_set():
            decision = next_restart(self.policy, ran_s, quick)
            quick = self._quick_exits = decision.quick_exits
            if quick > self.cfg.worker_restarts:
                self.failure = (f"engine worker died {quick} times in a row, each within "
                                f"{self.policy.healthy_after_s:g} s of its start (last: {reason})")
                log.error("%s; giving up", self.failure)
                if self.on_give_up is not None:
                    self.on_give_up(self.failure)
                return
            log.warning("engine worker pid %d %s after %.1f s; restarting in %.1f s", pid, reason, ran_s,
                        decision.delay_s)
            if self._stop.wait(decision.delay_s):
                return
            self._generation += 1
            try:
                self._launch()
                self.restarts += 1
                return
            except (ValueError, EOFError, OSError) as e:
                reason, ran_s = f"failed to reload: {e or type(e).__name__}", 0.0
