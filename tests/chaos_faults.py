"""The chaos soak's faults: a schedule drawn from a seed (printed, so a failing run can be replayed) and
a thread that applies it to a :class:`~chaos_mesh.ChaosMesh`.

Faults: ``kill`` (SIGKILL a node, start it again ``hold_s`` later under the same id), ``stop``
(SIGSTOP a node, SIGCONT ``hold_s`` later), ``tracker`` (SIGKILL the tracker, start it again on the
same port and ledger ``hold_s`` later) and ``stop-range`` (SIGSTOP every replica of one range for longer
than a client's failover deadline, so that the streams on it must fail with a clear error). A single-node
fault is applied only while another replica of its range is up, so streams can finish; one that would
leave a range empty is skipped and logged.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from dataclasses import dataclass

from chaos_mesh import ChaosMesh, NodeSlot

# Longer than the API's failover deadline (8 s) plus hung-node detection (~2 s): streams on the range fail.
RANGE_STOP_S = 12.0


@dataclass(frozen=True)
class Fault:
    at_s: float  # seconds after the soak started
    kind: str  # "kill", "stop", "tracker" or "stop-range"
    target: str  # node id, range ("0:15") or "tracker"
    hold_s: float  # seconds until the node or tracker is restarted / resumed

    def __str__(self) -> str:
        return f"t={self.at_s:6.2f}s {self.kind:<10} {self.target:<8} for {self.hold_s:.2f}s"


def draw_schedule(seed: int, duration_s: float, node_ids: list[str], ranges: list[str]) -> list[Fault]:
    """Faults every 2-5 s from t = 3 s until ``duration_s`` - 5 s. One ``stop-range`` per started minute
    (not in the last 15 s, so its streams' failures are seen before the soak ends); the rest are node
    kills and stops (40% each) and tracker kills (20%). Pure: the same arguments give the same list."""
    rng = random.Random(seed)
    faults, t = [], 3.0
    range_stops_due = 1 + int(duration_s // 60)
    while t < duration_s - 5:
        if range_stops_due and t > 10 and t < duration_s - RANGE_STOP_S - 15 and rng.random() < 0.25:
            range_stops_due -= 1
            faults.append(Fault(round(t, 2), "stop-range", rng.choice(ranges), RANGE_STOP_S))
            t += RANGE_STOP_S + rng.uniform(1, 3)
            continue
        r = rng.random()
        if r < 0.4:
            faults.append(Fault(round(t, 2), "kill", rng.choice(node_ids), round(rng.uniform(0.5, 4), 2)))
        elif r < 0.8:
            faults.append(Fault(round(t, 2), "stop", rng.choice(node_ids), round(rng.uniform(0.5, 5), 2)))
        else:
            faults.append(Fault(round(t, 2), "tracker", "tracker", round(rng.uniform(0.5, 4), 2)))
        t += rng.uniform(2, 5)
    return faults


class FaultRunner:
    """Applies a schedule on a thread; ``log`` lists what happened (applied, skipped, restarted), with
    times in seconds since :meth:`start`."""

    def __init__(self, mesh: ChaosMesh, schedule: list[Fault]) -> None:
        self.mesh, self.schedule = mesh, schedule
        self.log: list[str] = []
        self.applied: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-faults", daemon=True)
        self._helpers: list[threading.Thread] = []
        self._t0 = 0.0
        self._tracker_up = True

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        """Stop applying faults, resume or restart everything that is down, and wait for it."""
        self._stop.set()
        self._thread.join(30)
        for h in self._helpers:
            h.join(120)
        for slot in self.mesh.nodes:
            if slot.state == "stopped":
                self._resume(slot)
            elif slot.state == "dead":
                self.mesh.start_node(slot)

    def _note(self, what: str) -> None:
        line = f"t={time.monotonic() - self._t0:6.2f}s {what}"
        self.log.append(line)
        print("chaos:", line, flush=True)

    def _later(self, delay_s: float, fn, *args) -> None:
        def run():
            self._stop.wait(delay_s)  # the end of the soak undoes a fault at once
            fn(*args)

        h = threading.Thread(target=run, daemon=True)
        h.start()
        self._helpers.append(h)

    def _run(self) -> None:
        for fault in self.schedule:
            if self._stop.wait(max(0.0, self._t0 + fault.at_s - time.monotonic())):
                return
            self._apply(fault)

    def _replicas(self, layers: str) -> list[NodeSlot]:
        return [s for s in self.mesh.nodes if s.layers == layers]

    def _apply(self, fault: Fault) -> None:
        mesh = self.mesh
        if fault.kind == "tracker":
            if not self._tracker_up:
                self._note("skip tracker: it is down already")
                return
            self._tracker_up = False
            mesh.kill_tracker()
            self._count(fault, f"SIGKILL tracker; restart in {fault.hold_s:.2f}s")
            self._later(fault.hold_s, self._restart_tracker)
            return
        if fault.kind == "stop-range":
            slots = [s for s in self._replicas(fault.target) if s.state == "up"]
            for s in slots:
                self._signal(s, signal.SIGSTOP, "stopped")
            self._count(fault, f"SIGSTOP {[s.node_id for s in slots]} (range {fault.target}) "
                               f"for {fault.hold_s:.2f}s")
            for s in slots:
                self._later(fault.hold_s, self._resume, s)
            return
        slot = next(s for s in mesh.nodes if s.node_id == fault.target)
        others_up = [s for s in self._replicas(slot.layers) if s is not slot and s.state == "up"]
        if slot.state != "up" or not others_up:
            self._note(f"skip {fault.kind} {slot.node_id}: it is {slot.state}, "
                       f"{len(others_up)} other replica(s) of {slot.layers} up")
            return
        if fault.kind == "kill":
            self._signal(slot, signal.SIGKILL, "dead")
            slot.proc.wait(10)
            self._count(fault, f"SIGKILL {slot.node_id}; restart in {fault.hold_s:.2f}s")
            self._later(fault.hold_s, self._restart_node, slot)
        else:
            self._signal(slot, signal.SIGSTOP, "stopped")
            self._count(fault, f"SIGSTOP {slot.node_id} for {fault.hold_s:.2f}s")
            self._later(fault.hold_s, self._resume, slot)

    def _count(self, fault: Fault, what: str) -> None:
        self.applied[fault.kind] = self.applied.get(fault.kind, 0) + 1
        self._note(what)

    def _signal(self, slot: NodeSlot, sig: int, state: str) -> None:
        with self.mesh.lock:
            slot.proc.send_signal(sig)
            slot.state = state

    def _resume(self, slot: NodeSlot) -> None:
        with self.mesh.lock:
            if slot.state != "stopped":
                return
            slot.proc.send_signal(signal.SIGCONT)
            slot.state = "up"
        self._note(f"SIGCONT {slot.node_id}")

    def _restart_node(self, slot: NodeSlot) -> None:
        ok = self.mesh.start_node(slot)
        self._note(f"{slot.node_id} {'serving again at ' + slot.address if ok else 'did not restart'}")

    def _restart_tracker(self) -> None:
        self.mesh.start_tracker()
        self._tracker_up = True
        self._note("tracker serving again")
