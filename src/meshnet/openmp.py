"""How long idle OpenMP threads spin: set for this process before ggml's CPU library loads.

ggml-python's CPU kernels run each graph on an OpenMP team (libgomp) and synchronise its ops with OpenMP
barriers. libgomp reads ``GOMP_SPINCOUNT`` once, when it loads, and by default lets a waiting thread spin
300,000 rounds (milliseconds) before it sleeps. On a machine with more runnable threads than cores (two
2-thread processes on 2 cores, a node beside its client) every barrier then waits for a descheduled
partner while the spinner burns the core that partner needs. Measured on a 2-core VM, SmolLM2, 2
threads: two ``meshnet generate`` at once decoded 4.4 tokens/s each by default and 31.8 with 1000
rounds; alone, 95-98 tokens/s by default and 97-101 with 1000 rounds (100 rounds or a passive wait:
27-31). So meshnet sets 1000 unless the user set ``GOMP_SPINCOUNT`` themselves.

``meshnet/__init__.py`` imports this module first, so it runs before any ``import ggml``.
"""

from __future__ import annotations

import os

SPIN_COUNT = "1000"
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
