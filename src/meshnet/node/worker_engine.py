"""The node's engine when it runs in a supervised worker process: the shard-engine interface the node's
servers call (``prefill``, ``decode``, ``cancel``, ``release``, ``health``, ...), forwarded to the worker.

Between workers (one died, the next is loading) the engine holds no session: steps raise
:class:`~meshnet.node.worker_wire.EngineUnavailable` (the node answers UNAVAILABLE), cancel and release
succeed (there is nothing left to free), ``health`` says not healthy and why, and the capabilities stay
those of the range, which the next worker loads again.
"""

from __future__ import annotations

from meshnet.contract import Capabilities, Health, Metrics, Outcome, Status, StepRequest, StepResult
from meshnet.node import worker_wire as ww
from meshnet.node.worker_supervisor import WorkerSupervisor

# How long Health waits for the worker (seconds): the node answers Health even while its worker hangs
# (not healthy, saying so) until the supervisor kills and replaces the worker; within the clients'
# liveness probe (meshnet.client.remote.LIVENESS_PROBE_S), so they fail over at once.
HEALTH_TIMEOUT_S = 0.3


class WorkerEngine:
    """Forwards engine calls to ``supervisor``'s current worker (started). Thread-safe."""

    def __init__(self, supervisor: WorkerSupervisor) -> None:
        self.supervisor = supervisor
        info = supervisor.info
        self._caps = info.caps
        self.device = info.device
        self.device_index = info.device_index

    def prefill(self, req: StepRequest) -> StepResult:
        """As ShardEngine.prefill. Raises EngineUnavailable when the worker is gone or dies during it,
        EngineCallFailed when the engine raised."""
        return self.supervisor.channel().call("prefill", req)

    def decode(self, req: StepRequest) -> StepResult:
        """As ShardEngine.decode; raises as :meth:`prefill`."""
        return self.supervisor.channel().call("decode", req)

    def start_step(self, req: StepRequest, decode: bool, on_done) -> None:
        """Start ``req`` (as :meth:`decode` when ``decode``, else :meth:`prefill`) without a thread waiting
        for it: ``on_done(StepResult | exception)`` is called once, on the worker channel's reading thread
        (see WorkerChannel.call_async). Raises EngineUnavailable at once between workers."""
        self.supervisor.channel().call_async("decode" if decode else "prefill", req, on_done=on_done)

    def _control(self, method: str, *args, empty=Outcome(Status.OK)):
        """A call whose answer, without a worker, is ``empty`` (the sessions died with the worker)."""
        try:
            return self.supervisor.channel().call(method, *args)
        except ww.EngineUnavailable:
            return empty

    def cancel(self, session_id: str) -> Outcome:
        return self._control("cancel", session_id)

    def release(self, session_id: str, keep_prefix: bool = True) -> Outcome:
        return self._control("release", session_id, keep_prefix)

    def release_superseded(self, session_id: str, epoch: int) -> Outcome:
        return self._control("release_superseded", session_id, epoch)

    def release_idle(self, idle_s: float, gap_factor: float = 0.0) -> list[str]:
        return self._control("release_idle", idle_s, gap_factor, empty=[])

    def session_ids(self) -> list[str]:
        return self._control("session_ids", empty=[])

    def metrics(self) -> Metrics:
        return self._control("metrics", empty=Metrics())

    def health(self) -> Health:
        """The worker's health; not healthy, with the reason, between workers."""
        try:
            return self.supervisor.channel().call("health", timeout_s=HEALTH_TIMEOUT_S)
        except ww.EngineUnavailable as e:
            return Health(loaded=False, healthy=False, active_sessions=0, message=self.supervisor.status or str(e))

    def capabilities(self) -> Capabilities:
        return self._caps

    def device_free_bytes(self) -> int:
        """Free bytes of the accelerator device (accelerator engines only); 0 between workers."""
        return self._control("device_free_bytes", empty=0)

    @property
    def loaded(self) -> bool:
        return not self.supervisor.status
