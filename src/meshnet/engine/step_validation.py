"""The checks a step passes before it runs: its request against the loaded stage, its tokens against its grammar.

Each check returns the refusal as ``(status, message)``, or None when the step may go on;
:class:`~meshnet.engine.base.ShardEngine` turns a refusal into the step's result (and counts it), before any
state changes and before the step joins a batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from meshnet.contract import MAX_DRAFT_TOKENS, Capabilities, Status, StepRequest

if TYPE_CHECKING:
    from meshnet.engine.session import Session

Problem = tuple[Status, str]

# The largest |value| hidden states may hold. Real residual streams peak around 1e3-1e4 (the "massive
# activations" of a few channels) and stay below 1e5; a stage's graph only sees their magnitude in the
# RMSNorm's sum of squares and the residual adds (everything after a norm is scale-free). That sum's x * x
# overflows float32 above ~1.8e19, and a backend summing n_embd squares in float32 overflows above
# ~1.8e19 / sqrt(n_embd) (~1e17 for 32768 elements), after which the tail samples from NaN or zero logits.
# 1e9 sits 10^4 above the largest real activations and 10^8 below the first overflow: no honest peer sends
# more, and nothing in a stage overflows below it (a refusal here comes before the step writes KV cells).
MAX_HIDDEN_MAGNITUDE = 1e9


def request_problem(req: StepRequest, caps: Capabilities | None, decode: bool,
                    chunk_tokens: int) -> Problem | None:
    """What is wrong with ``req`` on its own (or for ``decode``) on the stage ``caps`` describes, whose
    scheduler cuts steps into micro-batches of ``chunk_tokens`` (0: none)."""
    if caps is None:
        return Status.FAILED_PRECONDITION, "engine not loaded"
    n = len(req.token_ids)
    if n == 0 and caps.needs_token_ids and req.hidden is not None:
        return (Status.INVALID_ARGUMENT,
                f"stage {caps.artifact.layers} picks experts by token id (hash-routed blocks) "
                f"and the step carries hidden states of shape {req.hidden.shape} without "
                f"their token ids")
    if n == 0:
        return Status.INVALID_ARGUMENT, "no tokens in the step"
    if req.verify and n > MAX_DRAFT_TOKENS + 1:
        return (Status.INVALID_ARGUMENT,
                f"a verification step takes the last token and at most {MAX_DRAFT_TOKENS} "
                f"draft tokens, got {n} tokens")
    if not 0 <= req.mtp_drafts <= MAX_DRAFT_TOKENS:
        return Status.INVALID_ARGUMENT, (f"mtp_drafts must be in [0, {MAX_DRAFT_TOKENS}], "
                                         f"got {req.mtp_drafts}")
    if req.verify and chunk_tokens and n > chunk_tokens:
        return Status.INVALID_ARGUMENT, (f"a verification step of {n} tokens exceeds the "
                                         f"stage's micro-batch of {chunk_tokens} tokens")
    if decode and n != 1 and not req.verify:
        return Status.INVALID_ARGUMENT, (f"decode takes exactly 1 token (or the last token "
                                         f"and its drafts in a verification step), got {n}")
    if req.position < 0:
        return Status.INVALID_ARGUMENT, f"negative position {req.position}"
    bad = [t for t in req.token_ids if not 0 <= int(t) < caps.n_vocab]
    if bad:
        return Status.INVALID_ARGUMENT, f"token id {bad[0]} outside the vocabulary [0, {caps.n_vocab})"
    if req.position + n > caps.n_ctx:
        return (Status.INVALID_ARGUMENT,
                f"{req.position + n} tokens exceed the context length {caps.n_ctx} "
                f"(position {req.position} + {n} new tokens)")
    if caps.is_head:
        if req.hidden is not None:
            return Status.INVALID_ARGUMENT, "the head stage takes token ids, not hidden states"
    else:
        if req.hidden is None:
            return (Status.INVALID_ARGUMENT,
                    f"stage {caps.artifact.layers} needs hidden states from the previous stage")
        problem = req.hidden.validate()
        if problem is None and req.hidden.dtype != "f32":
            problem = f"hidden states must be f32, got {req.hidden.dtype}"
        want = (n, *caps.hidden_row_shape)
        if problem is None and req.hidden.shape != want:
            problem = f"hidden states have shape {req.hidden.shape}, expected {want} for {n} tokens"
            if caps.needs_token_ids and req.hidden.shape[1:] == want[1:]:
                problem += (": this stage picks experts by token id (hash-routed blocks) and needs "
                            "one token id per row")
        if problem is None:
            problem = hidden_values_problem(req.hidden.to_numpy())
        if problem is not None:
            return Status.INVALID_ARGUMENT, problem
    # Checked on every stage, not only the tail that samples: a head took a step with temperature NaN and
    # opened its session (cells reserved for the whole answer) before the tail refused it.
    problem = req.sampling.validate(caps.n_vocab)
    if problem is not None:
        return Status.INVALID_ARGUMENT, problem
    return None


def new_session_problem(req: StepRequest, decode: bool, fence: int, n_sessions: int,
                        max_sessions: int) -> Problem | None:
    """Why ``req`` may not open a session on a stage that caches none under its id: its epoch is older
    than ``fence`` (the epoch the session moved to), it is a decode or starts past position 0 (a cache
    miss: the client replays), or the stage already holds ``max_sessions`` (``n_sessions`` now)."""
    if req.epoch < fence:
        return (Status.FAILED_PRECONDITION,
                f"stale route epoch {req.epoch} for session {req.session_id!r} (it moved to epoch {fence})")
    if decode or req.position != 0:
        return (Status.NOT_FOUND,
                f"session {req.session_id!r} is not cached here (released, expired or never prefilled); "
                "replay it from position 0")
    if n_sessions >= max_sessions:
        return Status.RESOURCE_EXHAUSTED, f"stage is at its limit of {max_sessions} sessions"
    return None


def session_problem(s: Session, req: StepRequest) -> Problem | None:
    """Why ``req`` may not run on the cached session ``s``: it was cancelled, the step's epoch is older
    than the session's, or the step does not start where the session's cache ends (a rollback step may
    start before it, never after)."""
    if s.cancelled:
        return Status.CANCELLED, f"session {req.session_id!r} was cancelled"
    if req.epoch < s.epoch:
        return (Status.FAILED_PRECONDITION,
                f"stale route epoch {req.epoch} for session {req.session_id!r} (session is at epoch {s.epoch})")
    if req.rollback and req.position > s.n_past:
        return (Status.FAILED_PRECONDITION,
                f"rollback step starts at position {req.position} but session {req.session_id!r} has only "
                f"{s.n_past} tokens cached")
    if not req.rollback and req.position != s.n_past:
        return (Status.FAILED_PRECONDITION,
                f"step starts at position {req.position} but session {req.session_id!r} has {s.n_past} "
                "tokens cached (a step that cuts the session back must say rollback)")
    return None


def grammar_problem(req: StepRequest, caps: Capabilities | None,
                    compiler: Callable[[], Any]) -> Problem | None:
    """On the tail, refuse a step whose grammar cannot be compiled (INVALID_ARGUMENT naming why);
    called outside the engine's lock: a new schema takes milliseconds to compile. ``compiler`` gives the
    :class:`~meshnet.grammar.GrammarCompiler`, or None when the engine has none."""
    grammar = req.sampling.grammar
    if grammar is None or caps is None or not caps.is_tail:
        return None
    grammars = compiler()
    if grammars is None:
        return Status.INVALID_ARGUMENT, f"the {caps.engine} engine cannot enforce a grammar"
    try:
        grammars.compile(grammar.json_schema)
    except ValueError as e:  # GrammarError
        return Status.INVALID_ARGUMENT, str(e)
    return None


def follow_grammar(session: Session, req: StepRequest, is_tail: bool,
                   compiler: Callable[[], Any]) -> Problem | None:
    """Bring the session's grammar matcher to the tokens before the step's first sample (a replay or a
    rollback rebuilds or rewinds it); INVALID_ARGUMENT when a token the step sends, other than a
    verification step's drafts, is one the grammar does not allow."""
    grammar = req.sampling.grammar
    if grammar is None or not is_tail:
        session.grammar = None
        return None
    try:
        if session.grammar is None or session.grammar.grammar != grammar:
            session.grammar = compiler().session(grammar)
        ids = [int(t) for t in req.token_ids]
        history = session.token_ids + (ids[:1] if req.verify else ids)
        ok = session.grammar.follow(history)
    except ValueError as e:  # GrammarError
        return Status.INVALID_ARGUMENT, str(e)
    if grammar.start + ok < len(history):
        at = grammar.start + ok
        return Status.INVALID_ARGUMENT, f"token {history[at]} at position {at} is not allowed by the step's grammar"
    return None


def hidden_values_problem(rows: np.ndarray) -> str | None:
    """What is wrong with the values of hidden states ``rows`` (``[n_tokens, *dims]`` f32), naming the first
    bad row: NaN or infinity, or a value beyond :data:`MAX_HIDDEN_MAGNITUDE`; None when all are fine. A
    broken or hostile peer sends them: the stage's arithmetic overflows, the tail samples token 0 from NaN
    logits (or raises), and every later stage would pass them on."""
    peak = np.abs(rows).max(axis=tuple(range(1, rows.ndim)))  # [n_tokens]; NaN propagates
    bad = ~(peak <= MAX_HIDDEN_MAGNITUDE)
    if not bad.any():
        return None
    row = int(np.argmax(bad))
    if not np.isfinite(peak[row]):
        return f"hidden states hold NaN or infinity (row {row} of {len(peak)})"
    return (f"hidden states hold a value of magnitude {float(peak[row]):.3g} (row {row} of {len(peak)}), "
            f"beyond the {MAX_HIDDEN_MAGNITUDE:.0e} a stage accepts: no model's activations reach it, and "
            f"the stage's arithmetic would overflow")
