"""How long idle OpenMP threads spin: set for this process before ggml's CPU library loads.

ggml-python's CPU kernels run each graph on an OpenMP team (libgomp) and synchronise its ops with OpenMP
barriers. libgomp reads ``GOMP_SPINCOUNT`` once, when it loads, and by default lets a waiting thread spin
300,000 rounds (milliseconds) before it sleeps. On a machine with more runnable threads than cores (two
2-thread processes on 2 cores, a node beside its client) every barrier then waits for a descheduled
partner while the spinner burns the core that partner needs. Measured on a 2-core VM, SmolLM2, 2
threads: two ``meshnet generate`` at once decoded 4.4 tokens/s each by default and 31.8 with 1000
rounds; alone, 95-98 tokens/s by default and 97-101 with 1000 rounds (100 rounds or a passive wait:
27-31). Deeper in a session 1000 rounds is too short: flash attention splits SmolLM2's 9 heads 5:4
between 2 threads, the early thread falls asleep at the barrier and waking it costs more than the wait.
Measured later (one decode step at depth 10 / 120 / 250, alone; then two processes at depth 120 at
once): 1000 rounds 10.1 / 13.5 / 15.7 ms and 34 ms each; 3000 rounds 13.96 ms at depth 250 and 52 ms
each; 10,000 rounds 13.75 and 121 ms; libgomp's default 9.9 / 11.8 / 14.2 ms and 930 ms each. So meshnet
sets 3000 unless the user set ``GOMP_SPINCOUNT`` themselves: nearly all of the default's speed alone, a
slowdown of 1.5x rather than 27x when processes oversubscribe the cores.

``meshnet/__init__.py`` imports this module first, so it runs before any ``import ggml``.
"""

from __future__ import annotations

import os

SPIN_COUNT = "3000"
# A process started by competitor_env() keeps libgomp's own defaults (llama.cpp's reference run is a
# Python process that imports meshnet too).
_KEEP_DEFAULTS = "MESHNET_KEEP_OPENMP_DEFAULTS"
# True when this process set GOMP_SPINCOUNT itself (the user had not).
APPLIED = "GOMP_SPINCOUNT" not in os.environ and os.environ.get(_KEEP_DEFAULTS) != "1"
if APPLIED:
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT


def competitor_env() -> dict[str, str]:
    """This process's environment for a program measured beside meshnet (llama.cpp): without the
    OpenMP setting meshnet made for itself, so the competitor runs with its own defaults."""
    env = dict(os.environ)
    if APPLIED and env.get("GOMP_SPINCOUNT") == SPIN_COUNT:
        del env["GOMP_SPINCOUNT"]
    env[_KEEP_DEFAULTS] = "1"
    return env
