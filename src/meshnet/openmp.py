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

A server is the other case. ``meshnet api`` running the stages itself has about 0.6 ms of Python between
one token's graph and the next (sampling, the step's result, the next step), longer than 3000 rounds
spin, so its OpenMP thread falls asleep after every graph; on a virtual machine waking it again costs
more than the spin would have (an idle vCPU halts: a graph of 8 small ops every 1 ms took 1.9 ms a round
with 3000 rounds and 1.2 ms with 30,000). One streaming request, 128 tokens, paired with the same server
at 3000 rounds (2-core AMD VM, SmolLM2, 2 threads, 40 alternating pairs): 30,000 rounds 1.033x, libgomp's
default 1.041x, and 30,000 against the default 1.003x; C = 8 aggregate showed no difference within the
VM's noise. The cost is the oversubscribed case: two ``meshnet generate`` at once, 2 threads each, took
8.5 s each at 3000 rounds and 40-57 s at 30,000. So the in-process API server, which holds the whole
model as one stage and serves as ``llama-server`` does (with libgomp's default), spins 30,000 rounds;
every other process (nodes, which ``meshnet up`` starts several of on one machine, several stages in one
process, ``meshnet generate``, the benches, the tests) keeps 3000.

``meshnet/__init__.py`` imports this module first, so it runs before any ``import ggml``; the command
line is all there is to tell the server by at that point.
"""

from __future__ import annotations

import os
import sys

SPIN_COUNT = "3000"
# ``meshnet api`` running the whole model as one stage in this process (see above).
SERVER_SPIN_COUNT = "30000"
# A process started by competitor_env() keeps libgomp's own defaults (llama.cpp's reference run is a
# Python process that imports meshnet too).
_KEEP_DEFAULTS = "MESHNET_KEEP_OPENMP_DEFAULTS"
# The value this module gave GOMP_SPINCOUNT, which child processes inherit with it: a meshnet child
# whose GOMP_SPINCOUNT is that value decides again for its own command (a bench's ``meshnet api``).
_SET_BY_MESHNET = "MESHNET_GOMP_SPINCOUNT"
_USER_SET = "GOMP_SPINCOUNT" in os.environ and os.environ["GOMP_SPINCOUNT"] != os.environ.get(_SET_BY_MESHNET)
# True when this process set GOMP_SPINCOUNT itself (the user had not).
APPLIED = not _USER_SET and os.environ.get(_KEEP_DEFAULTS) != "1"


def spin_count_for(argv: list[str]) -> str:
    """The spin this process gets from its command line ``argv`` (``sys.argv``: the program, then the
    subcommand): :data:`SERVER_SPIN_COUNT` for ``meshnet api`` running the whole model as one stage
    here (no ``--tracker``, no ``--stages`` above 1, no ``--layers`` list), else :data:`SPIN_COUNT`.
    Several stages in one process take turns, so each one's thread would spin through the others'
    graphs on the cores they need (one stream, 3 stages: 0.974x at 30,000 rounds, 10 pairs)."""
    if len(argv) < 2 or argv[1] != "api":
        return SPIN_COUNT
    import argparse  # here: only the API's command line is read, and meshnet's own import stays light

    # The three options of ``meshnet api`` that say where its stages run, read as its parser reads them
    # (abbreviations and ``--name=value`` included); that parser cannot be built yet: it loads ggml.
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    for name in ("--tracker", "--stages", "--layers"):
        parser.add_argument(name)
    try:
        known, _ = parser.parse_known_args(argv[2:])
    except argparse.ArgumentError:  # ``meshnet api`` will refuse this command line itself
        return SPIN_COUNT
    one_stage = (known.stages or "1").strip() == "1" and "," not in (known.layers or "")
    return SERVER_SPIN_COUNT if known.tracker is None and one_stage else SPIN_COUNT


if APPLIED:
    os.environ["GOMP_SPINCOUNT"] = os.environ[_SET_BY_MESHNET] = spin_count_for(sys.argv)


def competitor_env() -> dict[str, str]:
    """This process's environment for a program measured beside meshnet (llama.cpp): without the
    OpenMP setting meshnet made for itself, so the competitor runs with its own defaults."""
    env = dict(os.environ)
    if APPLIED:
        env.pop("GOMP_SPINCOUNT", None)
        env.pop(_SET_BY_MESHNET, None)
    env[_KEEP_DEFAULTS] = "1"
    return env
