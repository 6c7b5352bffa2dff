"""Keep a set of child processes running: restart each one that exits, with the backoff of
:mod:`meshnet.restart_policy`, and say so on stderr. ``meshnet up`` supervises its node processes with it;
a child that calls :func:`follow_supervisor` ends when the supervisor dies, however it dies. Where a
command stops its children itself (``meshnet bench``), :func:`sigterm_as_interrupt` has a SIGTERM do that
as Ctrl-C does.
"""

from __future__ import annotations

import collections
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, TextIO

from meshnet.restart_policy import RestartPolicy, exit_reason, next_restart

# How often the watcher looks for exits and due restarts (seconds).
_POLL_S = 0.1
# Lines of each child's stderr kept to explain its exit.
_LOG_LINES = 50
# How long to wait for an exited child's remaining stderr before reporting the exit (seconds).
_LAST_WORDS_S = 0.5
# Lines a child wrote this long before it exited are its last words, quoted to explain the exit (seconds);
# older ones (its start-up lines, minutes before a SIGKILL) explain nothing and read as if they did.
_LAST_WORDS_WINDOW_S = 5.0
# How a child logs (``meshnet node`` and its engine worker): its lines at WARNING and above are passed on
# to the supervisor's own output as they come (a worker restarted, a next hop unreachable), at most
# _ECHO_BURST a child per _ECHO_WINDOW_S seconds, those held back counted in the next one passed on.
CHILD_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
_ECHO_LEVELS = frozenset({"WARNING", "ERROR", "CRITICAL"})
_ECHO_BURST, _ECHO_WINDOW_S = 5, 10.0
# The exit status of a node that refused its settings (a bad flag, a model that does not load): starting
# it again would only fail again, so it is not restarted.
EXIT_REFUSED = 2


# Set in every child's environment to the supervisor's pid (see follow_supervisor).
SUPERVISOR_PID_ENV = "MESHNET_SUPERVISOR_PID"


def die_with_parent(sig: int) -> None:
    """Have the kernel send this process ``sig`` when its parent dies (Linux's PR_SET_PDEATHSIG: strictly,
    when the parent's thread that started it ends); elsewhere nothing."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def on_stop_signals(stop: Callable[[], None], again: Callable[[], None] | None = None) -> dict[int, object]:
    """Call ``stop()`` at the first SIGTERM or SIGINT; later ones call ``again()`` (Ctrl-C pressed again:
    stop now), or do nothing. ``again`` must only set a plain flag (see below). Returns the handlers
    replaced (signal -> handler), to put back. Main thread only.

    Why once: Python runs a handler between two bytecodes of the main thread, inside another handler
    too, and ``threading.Event.set`` holds a lock that is not re-entrant. A second signal landing while
    the first handler held it (Ctrl-C pressed twice, or ``meshnet up``'s SIGTERM right after the
    terminal's SIGINT to the whole process group) left a node blocked on its own lock for good. The
    mark is set before ``stop()`` runs, so a nested handler returns at once."""
    fired: list[int] = []

    def handler(signum, frame) -> None:
        if fired:
            if again is not None:
                again()
            return
        fired.append(signum)
        stop()

    return {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}


class Terminated(KeyboardInterrupt):
    """A SIGTERM, raised where Ctrl-C raises KeyboardInterrupt (see :func:`sigterm_as_interrupt`)."""


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While inside, the first SIGTERM raises :class:`Terminated` in the main thread: a KeyboardInterrupt,
    so the ``finally`` blocks and ``with`` exits that stop a Ctrl-C'd run's children (node processes,
    servers, network namespaces) run for it too. By default a SIGTERM ended the process on the spot and
    left all of them behind. Later SIGTERMs are ignored until the block is left: one more (``kill``
    again, a service manager that repeats it) raised inside the cleanup and cut it short. The previous
    handler is put back on leaving. Outside the main thread, or where SIGTERM is ignored (the parent
    asked for that), nothing changes."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is signal.SIG_IGN):
        yield
        return
    fired: list[int] = []

    def handler(signum, frame) -> None:
        if fired:
            return
        fired.append(signum)
        raise Terminated(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def signals_deferred() -> Iterator[None]:
    """While inside, a Ctrl-C (SIGINT) or SIGTERM is held until the block is left, then handled as it would
    have been: for a block that starts a child process and keeps it to stop later. A signal that landed
    inside ``subprocess.Popen``, after the fork but before it returned, raised there: the child ran on
    with nothing holding it to stop (a bench sent SIGTERM while its server loaded left that server
    running). Main thread only (the only one Python's handlers run in); elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        if callable(signal.getsignal(sig)) or signal.getsignal(sig) == signal.SIG_DFL:
            previous[sig] = signal.signal(sig, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in dict.fromkeys(held):  # each signal once, in the order they came
            if callable(previous[sig]):
                previous[sig](sig, None)
            else:
                signal.raise_signal(sig)  # its default action, now that the handler is back


def wait_for_stop(stop: threading.Event) -> None:
    """Until ``stop`` is set (by :func:`on_stop_signals`' handler), waking twice a second: a SIGTERM the
    kernel hands to another thread only flags its handler for the main thread, which an untimed wait
    never wakes to run (one node in about ten, sent 200 signals at once, never drained). Main thread."""
    while not stop.wait(0.5):
        pass


def announce(line: str) -> None:
    """Print ``line`` (a READY line) on stdout for whoever started this server. A stdout nobody reads any
    more (a closed pipe, a full disk) does not stop the server, which exited 0 at its READY line, still
    registered: stdout goes to /dev/null from then on, with a warning on stderr."""
    try:
        print(line, flush=True)
    except OSError as e:
        print(f"warning: stdout cannot be written ({e.strerror or e}); serving on without it", file=sys.stderr,
              flush=True)
        stdout_to_devnull()


def stdout_to_devnull() -> None:
    """Point stdout's descriptor at /dev/null: what it still buffers, and all later output, goes nowhere
    rather than failing again (its reader gone, its disk full)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def follow_supervisor() -> bool:
    """In a process a :class:`Supervisor` started: be sent SIGTERM (drain, then exit) when the supervisor
    dies, so a killed ``meshnet up`` leaves no node running. False when the supervisor is gone already.

    Raises:
        ValueError: the supervisor's variable holds something other than a process id.
    """
    pid = os.environ.get(SUPERVISOR_PID_ENV)
    if not pid:
        return True
    if not pid.isdigit():
        raise ValueError(f"${SUPERVISOR_PID_ENV} must be the supervisor's process id, not {pid[:40]!r} "
                         f"(meshnet up sets it for its nodes; unset it)")
    die_with_parent(signal.SIGTERM)
    return os.getppid() == int(pid)  # else it died before the line above took effect


@dataclass
class _Child:
    name: str
    argv: list[str]
    proc: subprocess.Popen | None = None
    started: float = 0.0
    quick_exits: int = 0
    restart_at: float | None = None  # monotonic seconds; None while running
    pump: threading.Thread | None = None  # copies the child's stderr into ``log``
    log: collections.deque = field(default_factory=lambda: collections.deque(maxlen=_LOG_LINES))  # (monotonic s, line)
    echo_since: float = float("-inf")  # the start of the window warnings are passed on in (monotonic s)
    echoed: int = 0  # warnings passed on in that window
    held: int = 0  # and held back


def _warning_in(line: str) -> str | None:
    """``"LEVEL: message"`` for a :data:`CHILD_LOG_FORMAT` line at WARNING or above, else None (INFO, a
    traceback's continuation lines, a line of another shape)."""
    parts = line.split(" ", 4)  # date, time, level, logger, message
    if len(parts) == 5 and parts[2] in _ECHO_LEVELS:
        return f"{parts[2].lower()}: {parts[4]}"
    return None


class Supervisor:
    """Start processes, restart those that exit, stop them all on :meth:`stop` (thread-safe).

    Args:
        children: ``(name, argv)`` per process; ``name`` (e.g. a node id) is what the messages call it.
        env: environment for the processes (default this one's).
        policy: restart backoff.
        on_exit: called with a child's name right after it exited (before its restart is scheduled),
            from the watcher thread; an exception it raises is reported and otherwise ignored.
        on_refused: called as ``on_refused(name, last_line)`` from the watcher thread when a child exits
            with :data:`EXIT_REFUSED` (its settings refused), which is not restarted.
        out: where restart messages go (default stderr), one line each, prefixed ``[meshnet up]``.

    Children get stdout discarded and stderr captured; the last lines of stderr are quoted when a child
    exits, and its warnings and errors (:data:`CHILD_LOG_FORMAT`) are passed on to ``out`` as they come.
    """

    def __init__(self, children: list[tuple[str, list[str]]], env: dict | None = None,
                 policy: RestartPolicy = RestartPolicy(), on_exit: Callable[[str], None] | None = None,
                 out: TextIO | None = None, on_refused: Callable[[str, str], None] | None = None) -> None:
        self.policy = policy
        self._children = [_Child(name, list(argv)) for name, argv in children]
        self._env = env
        self._on_exit = on_exit
        self._on_refused = on_refused
        self._out = out
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._hurried = False  # a plain flag: set from a signal handler (see hurry)
        self._thread: threading.Thread | None = None
        self.restarts = 0  # how many restarts so far, all children together

    def start(self) -> None:
        """Start every child and the watcher thread; none once :meth:`halt` was called (a signal that came
        while they were being started stops the rest)."""
        with self._lock:
            for child in self._children:
                if self._stop.is_set():
                    return
                self._spawn(child)
        self._thread = threading.Thread(target=self._watch, daemon=True, name="supervisor")
        self._thread.start()

    def pids(self) -> dict[str, int | None]:
        """Each child's current pid (None while it waits to be restarted)."""
        with self._lock:
            return {c.name: (c.proc.pid if c.proc and c.restart_at is None else None) for c in self._children}

    def halt(self) -> None:
        """Restart nothing from now on (safe to call from a signal handler: it only sets a flag).

        Ctrl-C in a terminal reaches the children too; without this they would be restarted while the
        parent is still on its way to :meth:`stop`."""
        self._stop.set()

    def hurry(self) -> None:
        """Make :meth:`stop` SIGKILL the children still running now rather than at its timeout (Ctrl-C
        pressed again). Only sets a flag: safe in a signal handler, and before :meth:`stop` too."""
        self._hurried = True

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stop restarting, SIGTERM every running child, and SIGKILL those still running after
        ``timeout_s`` seconds, or as soon as :meth:`hurry` is called."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            running = [c.proc for c in self._children if c.proc is not None and c.proc.poll() is None]
        for proc in running:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while any(proc.poll() is None for proc in running) and time.monotonic() < deadline and not self._hurried:
            time.sleep(0.05)
        if self._hurried and (left := sum(proc.poll() is None for proc in running)):
            self._say(f"stopping now: killing the {left} still running")  # the second Ctrl-C is heard
        for proc in running:
            if proc.poll() is None:
                proc.kill()
            proc.wait()

    # ---- internals -------------------------------------------------------------------------------
    def _say(self, message: str) -> None:
        print(f"[meshnet up] {message}", file=self._out or sys.stderr, flush=True)

    def _spawn(self, child: _Child) -> None:
        """Start ``child`` (lock held)."""
        env = {**(self._env if self._env is not None else os.environ), SUPERVISOR_PID_ENV: str(os.getpid())}
        child.proc = subprocess.Popen(child.argv, env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True)
        child.started, child.restart_at = time.monotonic(), None
        child.pump = threading.Thread(target=self._pump, args=(child, child.proc), daemon=True)
        child.pump.start()

    def _pump(self, child: _Child, proc: subprocess.Popen) -> None:
        for line in proc.stderr:
            now, line = time.monotonic(), line.rstrip()
            with self._lock:  # _schedule reads the log under the lock
                child.log.append((now, line))
                echo = self._echo(child, line, now)
            if echo is not None:
                self._say(echo)

    @staticmethod
    def _echo(child: _Child, line: str, now: float) -> str | None:
        """What to say of ``child``'s stderr ``line``: its warning, unless the window's are used up (lock
        held)."""
        if (said := _warning_in(line)) is None:
            return None
        held = 0
        if now - child.echo_since >= _ECHO_WINDOW_S:
            held, child.echo_since, child.echoed, child.held = child.held, now, 0, 0
        if child.echoed >= _ECHO_BURST:
            child.held += 1
            return None
        child.echoed += 1
        return f"node {child.name}: {said}" + (f" ({held} more held back before this)" if held else "")

    def _watch(self) -> None:
        while not self._stop.wait(_POLL_S):
            now = time.monotonic()
            with self._lock:
                exited = [c for c in self._children if c.restart_at is None and c.proc.poll() is not None]
            for child in exited:
                # Its last lines (often the reason it exited) may still be in the pipe.
                child.pump.join(timeout=_LAST_WORDS_S)
            with self._lock:
                for child in exited:
                    self._schedule(child, now)
                for child in self._children:
                    if child.restart_at is not None and child.restart_at <= now and not self._stop.is_set():
                        self._spawn(child)
                        self.restarts += 1
                        self._say(f"node {child.name} restarted (pid {child.proc.pid})")

    def _schedule(self, child: _Child, now: float) -> None:
        """``child`` exited: report it and pick when to start it again (lock held)."""
        ran = max(0.0, now - child.started)
        if child.proc.returncode == EXIT_REFUSED:
            why = child.log[-1][1] if child.log else "no output"
            child.restart_at = float("inf")  # never: it would refuse again
            self._say(f"node {child.name} refused its settings, not restarted: {why}")
            if self._on_refused is not None:
                self._on_refused(child.name, why)
            return
        decision = next_restart(self.policy, ran, child.quick_exits)
        child.quick_exits, child.restart_at = decision.quick_exits, now + decision.delay_s
        last = " | ".join(line for t, line in list(child.log)[-3:] if t >= now - _LAST_WORDS_WINDOW_S) or \
            f"no output in its last {_LAST_WORDS_WINDOW_S:g} s"
        self._say(f"node {child.name} {exit_reason(child.proc.returncode)} after {ran:.1f} s ({last}); "
                  f"restarting in {decision.delay_s:g} s")
        if self._on_exit is not None:
            try:
                self._on_exit(child.name)
            except Exception as e:  # noqa: BLE001 - a failing hook must not stop the restarts
                self._say(f"after node {child.name} exited: {type(e).__name__}: {e}")
