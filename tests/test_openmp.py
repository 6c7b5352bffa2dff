"""meshnet's OpenMP spin setting: applied before ggml loads unless the user chose one, and kept away
from the llama.cpp runs it is measured against."""

from __future__ import annotations

import json
import os
import subprocess
import sys

_PROBE = ("import json, os, meshnet.engine.ggml_backend, meshnet.openmp as o; "
          "print(json.dumps([os.environ.get('GOMP_SPINCOUNT'), o.APPLIED, o.competitor_env().get('GOMP_SPINCOUNT'), "
          "o.competitor_env().get('MESHNET_KEEP_OPENMP_DEFAULTS')]))")


def _probe(*args: str, **env: str) -> list:
    """What a process whose command line is ``args`` (after the program) gets, in ``env``."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("GOMP_SPINCOUNT", "MESHNET_GOMP_SPINCOUNT", "MESHNET_KEEP_OPENMP_DEFAULTS")}
    out = subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True, text=True,
                         env={**base, **env}, check=True)
    return json.loads(out.stdout)


def test_meshnet_sets_a_short_spin_unless_told_otherwise():
    assert _probe() == ["3000", True, None, "1"]
    assert _probe("node", "--threads", "2") == ["3000", True, None, "1"]
    assert _probe(GOMP_SPINCOUNT="5") == ["5", False, "5", "1"]  # the user's own choice stays, for all
    assert _probe("api", GOMP_SPINCOUNT="5") == ["5", False, "5", "1"]
    assert _probe(MESHNET_KEEP_OPENMP_DEFAULTS="1") == [None, False, None, "1"]  # a competitor's run


def test_the_in_process_api_server_spins_long_enough_to_bridge_its_python_between_graphs():
    assert _probe("api", "--threads", "2") == ["30000", True, None, "1"]
    # over a mesh the API process runs no graph: the short spin
    assert _probe("api", "--tracker", "127.0.0.1:7000") == ["3000", True, None, "1"]
    assert _probe("api", "--tracker=127.0.0.1:7000") == ["3000", True, None, "1"]
    # stages that take turns in one process would spin through each other's graphs: the short spin
    assert _probe("api", "--stages", "3") == ["3000", True, None, "1"]
    assert _probe("api", "--stages=2") == ["3000", True, None, "1"]
    assert _probe("api", "--layers", "0:10,10:30") == ["3000", True, None, "1"]
    assert _probe("api", "--stages", "1", "--port", "8001") == ["30000", True, None, "1"]
    assert _probe("api", "--layers=0:30") == ["30000", True, None, "1"]
    # a bench (3000, set by meshnet) starting ``meshnet api``: the child decides for itself
    assert _probe("api", GOMP_SPINCOUNT="3000", MESHNET_GOMP_SPINCOUNT="3000") == ["30000", True, None, "1"]
    assert _probe("node", GOMP_SPINCOUNT="30000", MESHNET_GOMP_SPINCOUNT="30000") == ["3000", True, None, "1"]
