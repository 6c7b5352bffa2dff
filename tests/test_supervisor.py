"""The process supervisor of ``meshnet up`` with cheap child processes: a killed child is restarted and
reported, a crash-looping one backs off, and stop() ends them all for good."""

from __future__ import annotations

import io
import os
import re
import signal
import sys
import time

from meshnet.restart_policy import RestartPolicy
from meshnet.supervisor import Supervisor

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]
CRASHER = [sys.executable, "-c", "import sys; print('boom: bad model', file=sys.stderr); sys.exit(3)"]


def _wait(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_killed_child_is_restarted_reported_and_the_others_keep_running():
    out, exits = io.StringIO(), []
    sup = Supervisor([("a", SLEEPER), ("b", SLEEPER)], policy=RestartPolicy(0.2, 1.0, 30.0),
                     on_exit=exits.append, out=out)
    sup.start()
    try:
        first = sup.pids()
        assert all(first.values())
        os.kill(first["a"], signal.SIGKILL)
        _wait(lambda: sup.pids()["a"] not in (None, first["a"]))
        again = sup.pids()
        assert again["b"] == first["b"]  # untouched
        assert exits == ["a"] and sup.restarts == 1
        lines = out.getvalue().splitlines()
        assert re.fullmatch(r"\[meshnet up\] node a killed by SIGKILL after \d+\.\d s \(no output in its last 5 s\); "
                            r"restarting in 0\.2 s", lines[0]), lines
        assert lines[1] == f"[meshnet up] node a restarted (pid {again['a']})"
    finally:
        sup.stop(timeout_s=5)
    # stop() ended (and reaped) every child and restarts none of them.
    assert [_alive(pid) for pid in again.values()] == [False, False]
    time.sleep(0.5)
    assert sup.restarts == 1


def test_a_crash_looping_child_backs_off_and_its_last_words_are_quoted():
    out = io.StringIO()
    sup = Supervisor([("c", CRASHER)], policy=RestartPolicy(0.1, 0.4, 30.0), out=out)
    sup.start()
    try:
        _wait(lambda: out.getvalue().count("exited with status 3") >= 4)
    finally:
        sup.stop(timeout_s=5)
    exits = [line for line in out.getvalue().splitlines() if "exited" in line]
    assert [re.search(r"restarting in (\S+) s", line).group(1) for line in exits[:4]] == ["0.1", "0.2", "0.4", "0.4"]
    assert "(boom: bad model)" in exits[0]


def test_halt_stops_restarts_at_once():
    out = io.StringIO()
    sup = Supervisor([("d", SLEEPER)], policy=RestartPolicy(0.05, 0.05, 30.0), out=out)
    sup.start()
    try:
        pid = sup.pids()["d"]
        sup.halt()
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
        assert sup.restarts == 0 and "restarted" not in out.getvalue()
    finally:
        sup.stop(timeout_s=5)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_child_that_refuses_its_settings_is_not_restarted_and_says_why():
    """Exit status 2 is a node refusing its flags (a model that does not load): restarting it only
    refuses again, without end."""
    refuser = [sys.executable, "-c", "import sys; print('error: not enough memory', file=sys.stderr); sys.exit(2)"]
    out, refused = io.StringIO(), []
    sup = Supervisor([("r", refuser), ("s", SLEEPER)], policy=RestartPolicy(0.1, 0.4, 30.0), out=out,
                     on_refused=lambda name, why: refused.append((name, why)))
    sup.start()
    try:
        _wait(lambda: refused)
        time.sleep(0.5)  # several restart delays: none comes
        assert refused == [("r", "error: not enough memory")] and sup.restarts == 0
        assert out.getvalue().splitlines() == [
            "[meshnet up] node r refused its settings, not restarted: error: not enough memory"]
        assert sup.pids()["s"] is not None
    finally:
        sup.stop(timeout_s=5)


def test_children_end_when_the_supervisor_is_killed(tmp_path):
    """A SIGKILLed `meshnet up` left its nodes running: a child that follows its supervisor gets SIGTERM
    (and drains) when the supervisor dies, however it dies."""
    import subprocess

    child = ("import signal, sys, time\n"
             "from meshnet.supervisor import follow_supervisor\n"
             "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
             "assert follow_supervisor()\n"
             "time.sleep(120)\n")
    middle = ("import sys, time\n"
              "from meshnet.supervisor import Supervisor\n"
              f"sup = Supervisor([('c', [sys.executable, '-c', {child!r}])])\n"
              "sup.start()\n"
              "time.sleep(1.5)\n"
              "print(sup.pids()['c'], flush=True)\n"
              "time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", middle], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(proc.stdout.readline())
        assert _alive(pid)
        proc.kill()
        proc.wait(10)
        _wait(lambda: not _alive(pid), 10)
    finally:
        proc.kill()


def test_a_sigterm_is_a_keyboard_interrupt_once_and_the_handler_is_put_back():
    """A bench's SIGTERM must reach the finally blocks a Ctrl-C reaches, and a second SIGTERM (``timeout``
    signals the whole process group) must not cut that cleanup short."""
    import pytest

    from meshnet.supervisor import Terminated, sigterm_as_interrupt

    before = signal.getsignal(signal.SIGTERM)
    cleaned = []
    with pytest.raises(KeyboardInterrupt) as raised:
        with sigterm_as_interrupt():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler raises before this ends
            finally:
                os.kill(os.getpid(), signal.SIGTERM)  # ignored: the cleanup runs to its end
                time.sleep(0.05)
                cleaned.append(True)
    assert type(raised.value) is Terminated and cleaned == [True]
    assert signal.getsignal(signal.SIGTERM) is before


def test_hurry_kills_at_once_the_children_a_stop_is_waiting_for():
    """stop() SIGTERMs the children and waits up to its timeout for them to exit (nodes draining their
    sessions); a second Ctrl-C at ``meshnet up`` hurries it: the children still running are SIGKILLed now.
    Before, the second Ctrl-C changed nothing and the wait ran its course (15 s)."""
    import threading

    stubborn = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                      "print('ready', flush=True); time.sleep(120)"]
    out = io.StringIO()
    sup = Supervisor([("a", stubborn), ("b", SLEEPER)], policy=RestartPolicy(0.2, 1.0, 30.0), out=out)
    sup.start()
    time.sleep(1.0)  # the stubborn child has set its handler
    pids = sup.pids()
    stopper = threading.Thread(target=sup.stop, kwargs={"timeout_s": 60.0})
    t0 = time.monotonic()
    stopper.start()
    time.sleep(0.5)
    assert stopper.is_alive()  # waiting for "a", which ignores SIGTERM ("b" is gone)
    sup.hurry()
    stopper.join(10)
    assert not stopper.is_alive() and time.monotonic() - t0 < 10
    assert out.getvalue().splitlines()[-1] == "[meshnet up] stopping now: killing the 1 still running"
    for pid in pids.values():
        _wait(lambda pid=pid: not os.path.exists(f"/proc/{pid}") or
              open(f"/proc/{pid}/stat").read().split()[2] == "Z")


def test_an_exit_quotes_only_what_the_child_said_just_before_it(monkeypatch):
    """A node SIGKILLed minutes after it started was reported with its start-up lines in parentheses,
    which read as the reason it died. Only lines from the last moments before the exit are quoted."""
    import meshnet.supervisor as supervisor

    monkeypatch.setattr(supervisor, "_LAST_WORDS_WINDOW_S", 0.5)
    talker = [sys.executable, "-c", "import sys, time; print('serving layers 0:12', file=sys.stderr, flush=True); "
                                    "time.sleep(120)"]
    out = io.StringIO()
    sup = Supervisor([("a", talker)], policy=RestartPolicy(0.2, 1.0, 30.0), out=out)
    sup.start()
    try:
        time.sleep(1.5)
        os.kill(sup.pids()["a"], signal.SIGKILL)
        _wait(lambda: "killed by SIGKILL" in out.getvalue())
    finally:
        sup.stop(timeout_s=5)
    [exited] = [line for line in out.getvalue().splitlines() if "killed by SIGKILL" in line]
    assert "(no output in its last 0.5 s)" in exited and "serving layers" not in exited, exited


def test_a_signal_while_a_bench_starts_its_server_stops_that_server(tmp_path, monkeypatch):
    """A SIGTERM that lands inside ``subprocess.Popen``, after the fork but before it returns, raised there:
    the server had started but the bench held nothing to stop it, and it ran on (seen as a `meshnet api`
    left running by a bench SIGTERMed while its server loaded). The signal is now held until Popen has
    returned, then raised, and the server is stopped."""
    import subprocess

    import pytest

    from meshnet.bench import served
    from meshnet.supervisor import Terminated, sigterm_as_interrupt

    real_popen = subprocess.Popen

    def popen_then_signal(*args, **kwargs):  # the signal comes after the fork, before Popen returns
        proc = real_popen(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)  # a handler that raises does so here
        return proc

    monkeypatch.setattr(served.subprocess, "Popen", popen_then_signal)
    server = served.Server("sleeper", lambda port: ["sleep", "60"], tmp_path)
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated):
        with sigterm_as_interrupt():
            server.start(timeout_s=30)
    assert server.proc is not None and server.proc.returncode == -signal.SIGTERM  # stopped by start itself
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_signals_deferred_holds_a_ctrl_c_to_the_end_of_its_block():
    from meshnet.supervisor import signals_deferred

    import pytest

    ran = []
    with pytest.raises(KeyboardInterrupt):
        with signals_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)
            ran.append("after the signal")
    assert ran == ["after the signal"] and signal.getsignal(signal.SIGINT) is signal.default_int_handler


WARNER = [sys.executable, "-c", "import logging, sys, time\n"
          "from meshnet.supervisor import CHILD_LOG_FORMAT\n"
          "logging.basicConfig(level=logging.INFO, format=CHILD_LOG_FORMAT, stream=sys.stderr)\n"
          "log = logging.getLogger('meshnet.node')\n"
          "log.info('serving layers 0:10')\n"
          "for i in range(7): log.warning('engine worker pid %d hung; restarting in 0.5 s', 100 + i)\n"
          "print('a line of another shape', file=sys.stderr, flush=True)\n"
          "time.sleep(120)\n"]


def test_a_childs_warnings_are_passed_on_as_they_come_five_in_ten_seconds():
    """`meshnet up` swallowed its nodes' stderr until one exited: an engine worker restarted, or a next hop
    unreachable, said nothing. Warnings and errors now reach its output; INFO lines and floods do not."""
    out = io.StringIO()
    sup = Supervisor([("0:10", WARNER)], out=out)
    sup.start()
    try:
        _wait(lambda: "a line of another shape" in "".join(line for _, line in sup._children[0].log))
        assert out.getvalue().splitlines() == [
            f"[meshnet up] node 0:10: warning: engine worker pid {100 + i} hung; restarting in 0.5 s" for i in range(5)]
        assert sup._children[0].held == 2
    finally:
        sup.stop(timeout_s=5)


def test_warnings_held_back_are_counted_in_the_next_window():
    from meshnet.supervisor import _Child

    child = _Child("n", [])
    line = "2026-12-07 17:44:03,664 ERROR meshnet.node step failed"
    said = [Supervisor._echo(child, line, t) for t in (0.0, 1, 2, 3, 4, 5, 6, 12.0)]
    assert said[:5] == ["node n: error: step failed"] * 5 and said[5:7] == [None, None]
    assert said[7] == "node n: error: step failed (2 more held back before this)"
    assert Supervisor._echo(child, "2026-12-07 17:44:03,664 INFO meshnet.node serving", 13.0) is None
    assert Supervisor._echo(child, "Traceback (most recent call last):", 13.0) is None
