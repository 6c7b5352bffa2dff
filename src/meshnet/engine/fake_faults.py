"""Faults the fake engine injects on request: slow steps, a memory budget, malformed output, and crashes,
from an exception up to a real death of the process (segfault, abort, exit, SIGKILL, a hang), chosen in
tests or from ``meshnet node --engine fake --fault ...``."""

from __future__ import annotations

import ctypes
import os
import signal
from dataclasses import dataclass


# How a FakeFaults crash happens (see FakeFaults.crash_kind).
CRASH_KINDS = ("raise", "segfault", "abort", "exit", "sigkill", "hang")


@dataclass(frozen=True)
class FakeFaults:
    """Faults the fake engine injects; the defaults inject none.

    Attributes:
        delay_s: seconds every prefill/decode call sleeps before computing. The sleep watches the session's
            cancel flag, so a cancelled step returns CANCELLED without waiting out the delay.
        memory_budget_bytes: KV bytes across all sessions on this stage (0 = unlimited). A step whose
            tokens would push the total over the budget returns RESOURCE_EXHAUSTED (with
            ``retry_after_s``) and changes nothing. When ``LoadSpec.memory_budget_bytes`` is also set the
            smaller budget applies.
        bytes_per_token: fixed KV cost of one cached token; a session costs ``n_past * bytes_per_token``.
        malformed_output: outputs keep their structure but are wrong in a way a validator can detect:
            a non-tail stage returns hidden states of the right shape and dtype filled with NaN; the tail
            returns token id ``n_vocab`` (one past the vocabulary) with a NaN log-prob. Session state
            still advances, as it would in an engine that computed garbage without noticing.
        crash_after_calls: after this many prefill/decode calls (counted from construction or the last
            :meth:`FakeEngine.set_faults`), the next call crashes as ``crash_kind`` says. None = never.
        crash_kind: how a call crashes: ``"raise"`` (it and every later call raise :class:`FakeCrash`,
            the process lives on), or a real death of the process: ``"segfault"`` (a read of address 0),
            ``"abort"`` (SIGABRT), ``"exit"`` (``os._exit(70)``), ``"sigkill"``, or ``"hang"`` (the
            process stops answering for good: it blocks in C holding the GIL, so no thread of it runs).
    """

    delay_s: float = 0.0
    memory_budget_bytes: int = 0
    bytes_per_token: int = 1024
    malformed_output: bool = False
    crash_after_calls: int | None = None
    crash_kind: str = "raise"

    def __post_init__(self) -> None:
        if self.crash_kind not in CRASH_KINDS:
            raise ValueError(f"crash_kind must be one of {', '.join(CRASH_KINDS)}; got {self.crash_kind!r}")
        if self.delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {self.delay_s}")
        if self.memory_budget_bytes < 0:
            raise ValueError(f"memory_budget_bytes must be >= 0, got {self.memory_budget_bytes}")
        if self.bytes_per_token < 0:
            raise ValueError(f"bytes_per_token must be >= 0, got {self.bytes_per_token}")
        if self.crash_after_calls is not None and self.crash_after_calls < 0:
            raise ValueError(f"crash_after_calls must be >= 0 or None, got {self.crash_after_calls}")


class FakeCrash(RuntimeError):
    """Raised by a prefill/decode call once ``FakeFaults.crash_after_calls`` is used up (a dead process)."""


def parse_fault_spec(text: str) -> tuple[FakeFaults, int]:
    """Faults from ``meshnet node --engine fake --fault TEXT``, and how many engine worker processes get them.

    ``TEXT`` is comma-separated ``key=value``: ``crash=KIND`` (a :data:`CRASH_KINDS` name) with
    ``after=N`` (prefill/decode calls that succeed first; default 0), ``delay=S`` (seconds every step
    sleeps), ``workers=K`` (the first K worker processes get the faults, later restarts run clean;
    default 1, 0 = every one). Example: ``crash=segfault,after=5``.

    Raises:
        ValueError: an unknown key, a bad value, or ``after`` without ``crash`` (the message names it).
    """
    fields: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key not in ("crash", "after", "delay", "workers"):
            raise ValueError(f"--fault {text!r}: expected comma-separated crash=KIND, after=N, delay=S, "
                             f"workers=K; got {part!r}")
        fields[key] = value
    if "after" in fields and "crash" not in fields:
        raise ValueError(f"--fault {text!r}: after=N needs crash=KIND")
    try:
        faults = FakeFaults(delay_s=float(fields.get("delay", 0)),
                            crash_after_calls=int(fields.get("after", 0)) if "crash" in fields else None,
                            crash_kind=fields.get("crash", "raise"))
        workers = int(fields.get("workers", 1))
    except ValueError as e:
        raise ValueError(f"--fault {text!r}: {e}") from None
    if workers < 0:
        raise ValueError(f"--fault {text!r}: workers must be >= 0, got {workers}")
    return faults, workers


def crash(kind: str, message: str) -> None:
    """Crash as ``kind`` says (see FakeFaults.crash_kind); returns only by raising FakeCrash."""
    if kind == "segfault":
        ctypes.string_at(0)
    elif kind == "abort":
        os.abort()
    elif kind == "exit":
        os._exit(70)
    elif kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "hang":
        # A C call through PyDLL keeps the GIL: every thread of the process stops, as in a native deadlock.
        ctypes.PyDLL(None).pause()
    raise FakeCrash(message)
