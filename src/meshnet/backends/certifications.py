"""The self-test results on record (``certifications.json`` in the meshnet cache).

A record is keyed by what it is valid for: the lane, the sha256 of ggml's libraries, this host and the
device (:func:`certification_key`); rebuilding ggml-python or moving to another machine invalidates it.
The self-test itself is :mod:`meshnet.backends.certify`.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

from meshnet.backends import installed
from meshnet.backends.lane_table import LANES

CERT_FILE = "certifications.json"


def cache_dir() -> Path:
    """``$MESHNET_CACHE_DIR``, else ``$XDG_CACHE_HOME/meshnet``, else ``~/.cache/meshnet``."""
    if os.environ.get("MESHNET_CACHE_DIR"):
        return Path(os.environ["MESHNET_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "meshnet"


def certification_key(name: str, device_description: str) -> str:
    """What a certification is valid for: the lane, these exact libraries, this host, this device."""
    return "|".join([name, installed.lib_sha256() or "no-ggml", platform.node(), device_description])


def load_certifications() -> dict[str, dict]:
    """key -> recorded self-test (a ``CertResult`` as a dict); empty when there is no readable file."""
    try:
        data = json.loads((cache_dir() / CERT_FILE).read_text())
    except (OSError, ValueError):
        return {}
    entries = data.get("entries") if isinstance(data, dict) else None
    return entries if isinstance(entries, dict) else {}


def save_certification(key: str, record: dict) -> Path:
    """Store one self-test result under ``key`` (replacing an older one); returns the file written.
    Written to a temporary file and renamed, so a reader never sees half a file."""
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    entries = load_certifications()
    entries[key] = record
    path = d / CERT_FILE
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"version": 1, "entries": entries}, indent=1, sort_keys=True))
    os.replace(tmp, path)
    return path


def _device_description(name: str, runtime: dict, device_index: int = 0) -> str | None:
    names = LANES[name].registry_names
    devs = [d for d in runtime["devices"] if d["backend"] in names]
    if device_index >= len(devs):
        return None
    return devs[device_index]["description"] or devs[device_index]["name"]


def recorded_certification(name: str, device_index: int = 0) -> dict | None:
    """The self-test on record for lane ``name`` with the libraries, host and ``device_index``-th device
    of the lane here now."""
    runtime, _ = installed.ggml_runtime()
    if runtime is None:
        return None
    desc = _device_description(name, runtime, device_index)
    if desc is None:
        return None
    return load_certifications().get(certification_key(name, desc))

