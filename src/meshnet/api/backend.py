"""What the HTTP API needs from the mesh: a client per request, the tokenizer, the context length and a
route check.

:class:`ApiBackend` is a small concrete class built either over an in-process
:class:`~meshnet.chain.LocalChain` (:func:`local_backend`) or over a running mesh found through its tracker
(:func:`mesh_backend`); tests build one directly with their own client factory and route check.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from pathlib import Path
from typing import Callable

from meshnet.contract import Status, StepRequest, StepResult
from meshnet.generation import StepClient
from meshnet.grammar import GrammarCompiler
from meshnet.speculative import DraftCosts, Speculation
from meshnet.tokenizer import GGUFTokenizer

log = logging.getLogger("meshnet.api")

# How long a request waits, in total, for a stage that is at its session or memory limit before the
# API gives up with 503. The engines suggest a back-off with each refusal.
ADMISSION_WAIT_S = 30.0


class ApiBackend:
    """Everything :func:`meshnet.api.app.create_app` needs.

    Args:
        new_client: returns the client one generation uses (``step``/``cancel``/``release``); it may return
            the same thread-safe object every time, since sessions have distinct ids.
        tokenizer: the served model's tokenizer.
        model_name: the id ``/v1/models`` lists and requests must name (when they name one).
        n_ctx: context length in tokens per session, or a zero-argument callable returning it (a mesh's
            context is only known once a route exists).
        check_route: raises :class:`~meshnet.client.mesh_client.MeshUnavailable` when no complete route
            exists; otherwise returns a description of the route (a list of hop strings). ``None`` means
            always available (in-process chains).
        max_concurrency: generations running at once; further requests wait their turn. Keep it at or
            under the stages' session limit.
        retry_after_s: the ``Retry-After`` value (seconds) sent with 503 answers.
    """

    def __init__(self, new_client: Callable[[], StepClient], tokenizer: GGUFTokenizer, model_name: str,
                 n_ctx: int | Callable[[], int], check_route: Callable[[], list[str]] | None = None,
                 max_concurrency: int = 8, retry_after_s: int = 2,
                 check_health: Callable[[], list[str]] | None = None) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self._new_client = new_client
        self.tokenizer = tokenizer
        self.model_name = model_name
        self._n_ctx = n_ctx
        self._check_route = check_route
        self._check_health = check_health
        self.max_concurrency = max_concurrency
        self.retry_after_s = retry_after_s
        self.closers: list[Callable[[], None]] = []
        # In process: (layer range, engine Metrics) of each stage, for /metrics; None over a mesh.
        self.stage_metrics: Callable[[], list] | None = None
        # Over a mesh: the client's failovers and the like, by name (see ApiMetrics); None in process.
        self.mesh_figures: Callable[[], dict[str, int]] | None = None
        # How generations draft tokens when a request does not say (``meshnet api --speculative``).
        self.speculation: Speculation | None = None
        # Step costs the server's drafting generations learn together (one route's, whatever the text).
        self.draft_costs = DraftCosts()
        # Why the model cannot draft by next-token prediction (None: it can; see speculative.mtp_problem).
        self.mtp_problem: str | None = "needs a model with next-token-prediction layers"
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()
        self.admission = AdmissionLine()  # first prefills waiting for room, in arrival order
        # Set when the server begins to stop: generations end at their next token with a 503, and requests
        # waiting for a slot stop waiting, so every answer ends cleanly within the server's grace period.
        self.stopping = threading.Event()

    @property
    def grammars(self) -> GrammarCompiler:
        """The grammar compiler for the served vocabulary, which checks a request's schema before any node
        runs (built on first use: half a second)."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.tokenizer.n_vocab)
            return self._grammars

    def new_client(self, wait_s: float = ADMISSION_WAIT_S, since: float | None = None) -> StepClient:
        """The client for one generation, wrapped so a busy stage is waited for (up to ``wait_s`` seconds
        for its first prefill) instead of failing; ``since``: when its request began to wait (monotonic
        seconds; default now), for the refusal's words."""
        return AdmissionRetry(self._new_client(), wait_s=wait_s, line=self.admission, since=since)

    @property
    def n_ctx(self) -> int:
        """Context length in tokens per session."""
        return self._n_ctx() if callable(self._n_ctx) else self._n_ctx

    def check_route(self) -> list[str]:
        """Describe the current complete route. Raises MeshUnavailable when there is none. Blocking
        (a tracker round trip for a mesh): call it off the event loop."""
        if self._check_route is None:
            return ["in-process"]
        return self._check_route()

    def check_health(self) -> list[str]:
        """:meth:`check_route` for ``/health``, which may probe more (``check_health``: over a mesh, the
        hops this API's requests found down lately). Raises MeshUnavailable. Blocking."""
        return self.check_route() if self._check_health is None else self._check_health()

    def close(self) -> None:
        """Release what the backend holds (mesh channels)."""
        for fn in self.closers:
            fn()


class AdmissionLine:
    """First prefills refused for lack of room (a stage at its session or KV limit) wait here, in arrival
    order: only the first in line retries, and a request that arrives while others wait queues behind
    them instead of trying first. So room that frees goes to the longest waiter, and the requests that
    give up at the deadline are the latest ones (without a line, whichever retried at the right moment
    got the room, and which requests failed depended on timing). One per API server; thread-safe."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._line: collections.deque[object] = collections.deque()

    @contextlib.contextmanager
    def place(self):
        """A place in the line for the block's duration (its ticket)."""
        ticket = object()
        with self._cv:
            self._line.append(ticket)
        try:
            yield ticket
        finally:
            with self._cv:
                self._line.remove(ticket)
                self._cv.notify_all()

    def wait_first(self, ticket: object, deadline: float, stop: Callable[[], bool]) -> bool:
        """Wait until ``ticket`` is first in line (True), the monotonic ``deadline`` passes or ``stop()``
        holds (False)."""
        with self._cv:
            return self._cv.wait_for(lambda: stop() or self._line[0] is ticket,
                                     max(0.0, deadline - time.monotonic())) and not stop()

    def waiting(self) -> int:
        """Requests in line now."""
        with self._cv:
            return len(self._line)

    def wake(self) -> None:
        """Have every waiter look at its ``stop`` again (a cancel)."""
        with self._cv:
            self._cv.notify_all()


class AdmissionRetry:
    """Wraps a client so that a first prefill refused with RESOURCE_EXHAUSTED (a stage at its session or
    memory limit, e.g. nodes shared with other users) is retried after the stage's suggested back-off,
    for up to ``wait_s`` seconds in total, in turn with the other waiting requests of ``line`` (the API
    server's :class:`AdmissionLine`; None: a line of its own). A first prefill that finds nobody in line
    goes to the stages at once, beside the others running. Any other result passes through unchanged.
    ``since``: when the request began to wait (monotonic seconds, default now: a wait for a generation slot
    comes first), so that a refusal says how long it waited in all."""

    def __init__(self, client: StepClient, wait_s: float = ADMISSION_WAIT_S,
                 line: AdmissionLine | None = None, since: float | None = None) -> None:
        self.client, self.wait_s = client, wait_s
        self.since = time.monotonic() if since is None else since
        self.line = line if line is not None else AdmissionLine()
        self._start = getattr(client, "step_async", None)  # looked up once: it is on every token's path
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()

    def step(self, req: StepRequest, decode: bool) -> StepResult:
        if decode or req.position != 0:
            return self.client.step(req, decode)
        deadline = time.monotonic() + self.wait_s
        res = None
        if self.line.waiting() == 0:
            # Nobody waits for room: straight to the stages, beside the other first prefills running (a
            # place in line held through a whole prefill kept every later request out until it ended).
            res = self.client.step(req, decode)
            if self._settled(res, deadline, req.session_id):
                return res
            self.client.release(req.session_id)  # stages before the refusing one may hold it
        with self.line.place() as ticket:
            while True:
                if res is not None:  # refused: the stage's back-off, holding the place
                    time.sleep(min(res.retry_after_s or 0.5, max(0.0, deadline - time.monotonic())))
                if not self.line.wait_first(ticket, deadline, lambda: self._is_cancelled(req.session_id)):
                    if res is not None:
                        return res
                    if self._is_cancelled(req.session_id):
                        return StepResult(Status.CANCELLED, f"session {req.session_id!r} was cancelled while "
                                                            f"it waited in line for room")
                    # never reached the front: the requests ahead held the room all along
                    return StepResult(Status.RESOURCE_EXHAUSTED, f"no room for a new session: waited "
                                      f"{time.monotonic() - self.since:.1f} s, for a generation slot and in line "
                                      "behind other requests", retry_after_s=2.0)
                res = self.client.step(req, decode)
                if self._settled(res, deadline, req.session_id):
                    return res
                # Stages before the refusing one may hold the session already: start clean.
                self.client.release(req.session_id)

    def _settled(self, res: StepResult, deadline: float, session_id: str) -> bool:
        """Whether ``res`` is the answer: anything but a refusal for lack of room, or one past the
        deadline or after a cancel."""
        return (res.status is not Status.RESOURCE_EXHAUSTED or time.monotonic() >= deadline
                or self._is_cancelled(session_id))

    def _is_cancelled(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self._cancelled

    def step_async(self, req: StepRequest, decode: bool,
                   on_done: Callable[[StepResult | BaseException], None]) -> bool:
        """Start a step without blocking where the wrapped client can (an in-process chain); returns
        False for a first prefill, which may have to be retried, and for a client that cannot."""
        if self._start is None or (not decode and req.position == 0):
            return False
        return self._start(req, decode, on_done)

    def cancel(self, session_id: str) -> None:
        with self._lock:
            self._cancelled.add(session_id)
        self.line.wake()
        self.client.cancel(session_id)

    def release(self, session_id: str) -> None:
        with self._lock:
            self._cancelled.discard(session_id)
        self.client.release(session_id)

    def charged_by_consumer(self, session_id: str) -> None:
        """As the client's (a mesh's charges the ledger; a chain in process has none)."""
        if (mark := getattr(self.client, "charged_by_consumer", None)) is not None:
            mark(session_id)

    def delivered(self, session_id: str, position: int) -> None:
        """As the client's."""
        if (charge := getattr(self.client, "delivered", None)) is not None:
            charge(session_id, position)


def local_backend(model: str = "smollm2", stages: int | None = None, layers: str | None = None,
                  n_threads: int = 2, n_ctx: int = 0, max_sessions: int = 16, name: str | None = None,
                  progress: bool = False, kv_tokens: int = 0, prefix_cache: int = 4,
                  huge_pages: bool = True) -> ApiBackend:
    """An :class:`ApiBackend` over an in-process chain of ggml engines (one per layer range).

    Args:
        model: a GGUF path or bundled name (``smollm2``).
        stages / layers: how to split the layers (see :func:`meshnet.local_mesh.plan_ranges`).
        n_threads: CPU threads per stage.
        n_ctx: context length per session (0 = the model's, capped at 4096).
        max_sessions: sessions each stage holds; also the API's concurrency limit.
        kv_tokens: KV cells each stage's sessions may reserve at once (0 = half the memory available).
        prefix_cache: finished sessions each stage keeps for prompts that start the same way.
        huge_pages: weights on transparent huge pages where they can be (``LoadSpec.huge_pages``).
        name: the served model id (default: ``model`` when it is a bundled name, else the file stem).

    Raises:
        ModelNotFound: unknown model name or missing package; ValueError: bad ranges or a failed load.
    """
    from meshnet.local_mesh import load_local_chain, plan_ranges
    from meshnet.model.bundled import resolve_model

    path = str(resolve_model(model))
    ranges = plan_ranges(path, stages, layers)
    chain = load_local_chain(path, ranges, n_threads=n_threads, n_ctx=n_ctx, progress=progress,
                             max_sessions=max_sessions, kv_tokens=kv_tokens,
                             prefix_cache=prefix_cache, huge_pages=huge_pages)
    tok = GGUFTokenizer.from_gguf(path)
    caps = [s.capabilities() for s in chain.stages]
    desc = [f"in-process {c.artifact.layers}" for c in caps]
    # A stage's context is what one session can hold there, its KV pool included (GgmlStage.session_tokens).
    backend = ApiBackend(lambda: chain, tok, name or served_name(model), min(c.n_ctx for c in caps),
                         check_route=lambda: desc, max_concurrency=min(c.max_sessions for c in caps))
    backend.chain = chain  # type: ignore[attr-defined]  # tests read the engines' health through it
    backend.stage_metrics = lambda: [(str(c.artifact.layers), s.metrics()) for c, s in zip(caps, chain.stages)]
    return backend


def mesh_backend(tracker: str, model: str = "smollm2", join_token: str | None = None,
                 tls_ca: str | None = None, name: str | None = None, max_concurrency: int = 8,
                 step_timeout_s: float = 60.0, forwarding: bool = True, client_id: str | None = None) -> ApiBackend:
    """An :class:`ApiBackend` over a running mesh: one shared MeshClient (sessions have distinct ids);
    ``forwarding``: node-to-node steps where the route allows (see :class:`MeshClient`); ``client_id``: who
    the ledger charges (default a random id).

    The GGUF must be readable here too: the API tokenizes and renders chat templates itself, and routes
    only to nodes serving the same model id (:func:`meshnet.model.manifest.model_id`).

    Raises:
        ModelNotFound: unknown model name or missing package.
    """
    from meshnet.client.mesh_client import MeshClient
    from meshnet.model.bundled import resolve_model
    from meshnet.model.gguf_file import open_gguf
    from meshnet.model.manifest import model_id
    from meshnet.model.hparams import ModelConfig

    path = str(resolve_model(model))
    tok = GGUFTokenizer.from_gguf(path)
    client = MeshClient(tracker, model_sha256=model_id(path), join_token=join_token, tls_ca=tls_ca,
                        step_timeout_s=step_timeout_s, forwarding=forwarding, client_id=client_id)
    # Until a route has been seen, assume the engines' default context (the model's, capped at 4096).
    from meshnet.api.route_watch import RouteWatch
    from meshnet.engine.ggml_stage import DEFAULT_MAX_CTX

    watch = RouteWatch(client, min(ModelConfig.from_reader(open_gguf(path)).n_ctx_train, DEFAULT_MAX_CTX))
    check_route, n_ctx = watch.check, watch.n_ctx
    try:
        check_route()
    except Exception as e:  # the mesh may come up after the API; /health reports it meanwhile
        # Not yet, not an error: the API serves (503 meanwhile) and finds the route as the nodes arrive.
        log.info("the mesh has no complete route yet (requests get 503 until it has): %s",
                 str(e).removeprefix("no route: "))
    backend = ApiBackend(lambda: client, tok, name or served_name(model), n_ctx, check_route=check_route,
                         max_concurrency=max_concurrency, check_health=lambda: watch.check(probe_found_down=True))
    backend.mesh_figures = client.figures
    backend.closers.append(client.close)
    return backend


def served_name(model: str) -> str:
    """What clients call the model: the bundled name, or the file's stem."""
    from meshnet.model.bundled import BUNDLED

    return model if model in BUNDLED else Path(model).stem
