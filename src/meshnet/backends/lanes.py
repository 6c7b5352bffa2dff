"""What this machine can do with each build lane of the ggml engine (the lanes themselves:
:mod:`meshnet.backends.lane_table`).

:func:`probe_lane` reports one lane in exactly one state:

* ``certified``: the installed ggml-python has the backend and its self-test
  (:mod:`meshnet.backends.certify`) passed on this machine for these very libraries.
* ``built``: the installed ggml-python has the backend, but it has not passed a self-test here (the
  reason says what is missing). Such a backend stays dark: nodes do not advertise it.
* ``available``: the tools to build the lane and a device to run it are here, but the installed
  ggml-python was not built with it (``scripts/build_ggml_lane.sh LANE``).
* ``skipped``: the lane cannot be built or run here; the reason is exact, e.g. ``nvcc is not on PATH``
  or ``platform linux is not darwin``.

A lane that is not built lists every obstacle in ``problems`` (toolchain first, then device); its
``reason`` is the first. Building cuda also needs the GPU (:func:`meshnet.backends.toolchain.build_problem`).

The checks live beside this module: :mod:`meshnet.backends.toolchain` (tools and devices before ggml is
built), :mod:`meshnet.backends.installed` (the ggml-python installed here) and
:mod:`meshnet.backends.certifications` (self-test results on record).

Nothing here imports ggml at module import time, so the build script can check a toolchain with a bare
``python3`` (``python -m meshnet.backends.lanes toolchain LANE``).
"""

from __future__ import annotations

import platform
import sys
from dataclasses import asdict, dataclass, field

from meshnet.backends import LANE_NAMES
from meshnet.backends import certifications, installed, toolchain
from meshnet.backends.errors import BackendUnavailable
from meshnet.backends.lane_table import LANES

STATES = ("available", "built", "certified", "skipped")


@dataclass(frozen=True)
class LaneReport:
    """What :func:`probe_lane` found for one lane (see the module docstring for the states).

    Attributes:
        lane: the lane's name.
        state: one of :data:`STATES`.
        reason: why the lane is in that state, exact and stable (e.g. ``nvcc is not on PATH``).
        cmake_switch: the lane's one CMake switch (None for cpu).
        buildable: the tools to build the lane are on this machine (a device is not needed to build).
        versions: tool name -> version string, None when the tool is not on PATH.
        ggml_version: ggml's own version (``ggml_version()``), None when ggml-python cannot be loaded.
        ggml_python_version: the installed ggml-python distribution's version.
        build_options: how the installed libraries were built, as far as can be known (see
            :func:`meshnet.backends.installed.build_options`).
        devices: the lane's devices in ggml's registry (name, description, memory in bytes).
        certification: the passed or failed self-test on record for these libraries here, or None.
        problems: for a lane that is not built, everything in the way (toolchain, then device); the
            reason is the first.
    """

    lane: str
    state: str
    reason: str
    cmake_switch: str | None
    buildable: bool
    versions: dict = field(default_factory=dict)
    ggml_version: str | None = None
    ggml_python_version: str | None = None
    build_options: dict = field(default_factory=dict)
    devices: tuple = ()
    certification: dict | None = None
    problems: tuple = ()

    def to_dict(self) -> dict:
        d = asdict(self)
        d["devices"] = list(self.devices)
        d["problems"] = list(self.problems)
        return d



def probe_lane(name: str, device_index: int = 0) -> LaneReport:
    """Report lane ``name`` on this machine (see the module docstring for the states); certification is
    looked up for the lane's ``device_index``-th device (0 = the first ggml lists).

    Cheap apart from the vendor tools it runs (each at most a few seconds) and hashing ggml's libraries
    once per process. Never builds or certifies anything.

    Raises:
        KeyError: ``name`` is not a lane.
    """
    lane = LANES[name]
    runtime, load_error = installed.ggml_runtime()
    tool_problems = toolchain.toolchain_problems(name)
    common = dict(lane=name, cmake_switch=lane.cmake_switch, buildable=not tool_problems,
                  versions=toolchain.lane_versions(lane), ggml_version=runtime["version"] if runtime else None,
                  ggml_python_version=installed.ggml_python_version(), build_options=installed.build_options(name))

    def report(state: str, reason: str, devices=(), cert=None, problems=()) -> LaneReport:
        return LaneReport(state=state, reason=reason, devices=tuple(devices), certification=cert,
                          problems=tuple(problems), **common)

    if lane.platform and sys.platform != lane.platform:
        return report("skipped", tool_problems[0], problems=tool_problems)
    in_registry = runtime is not None and any(n in runtime["backends"] for n in lane.registry_names)
    if name == "cpu" or in_registry or installed.has_library(name):
        if runtime is None:
            reason = f"ggml-python cannot be loaded: {load_error}"
            return report("skipped" if name == "cpu" else "built", reason, problems=[reason])
        if not in_registry:
            return report("built", f"{installed.lib_names(lane.library)[0]} is installed but ggml's registry has no "
                                   f"{lane.registry_names[0]} backend")
        devices = [d for d in runtime["devices"] if d["backend"] in lane.registry_names]
        if not devices:
            # The vendor tool may see a device ggml skips (llvmpipe without GGML_VK_VISIBLE_DEVICES).
            hint = toolchain.device_problem(name)
            return report("built", f"ggml's {lane.registry_names[0]} backend finds no device"
                                   + (f" ({hint})" if hint else ""))
        if device_index >= len(devices):
            return report("built", f"ggml's {lane.registry_names[0]} backend lists {len(devices)} device(s), "
                                   f"no device {device_index}", devices)
        cert = certifications.recorded_certification(name, device_index)
        if cert is None:
            if name == "cpu":  # the reference itself: served and advertised either way
                return report("built", "usable: the reference every node may serve with (not certified here; "
                                       "`meshnet backends --certify` checks it against llama.cpp's goldens)", devices)
            return report("built", "not certified on this machine: run `meshnet backends --certify`",
                          devices)
        if not cert.get("passed"):
            return report("built", f"self-test failed: {cert.get('reason', 'no reason recorded')}", devices, cert)
        return report("certified", cert.get("reason", "self-test passed"), devices, cert)

    dev_problem = toolchain.device_problem(name)
    problems = tool_problems + ([dev_problem] if dev_problem else [])
    if problems:
        return report("skipped", problems[0], problems=problems)
    return report("available", f"toolchain and device present; ggml-python is not built with it: run "
                               f"scripts/build_ggml_lane.sh {name}")


def probe_all(device_index: int = 0) -> list[LaneReport]:
    """:func:`probe_lane` for every lane, in table order (accelerators for their ``device_index``-th
    device)."""
    return [probe_lane(n, 0 if n == "cpu" else device_index) for n in LANE_NAMES]


def require_certified(name: str, device_index: int = 0) -> LaneReport:
    """The lane's report when a node may compute on it (its ``device_index``-th device) and advertise
    it; cpu is always allowed (it is the engine's default path, proved by the golden tests).

    Raises:
        ValueError: unknown lane.
        BackendUnavailable: an accelerator lane that is not certified here; ``reason`` is the probe's.
    """
    if name not in LANES:
        raise ValueError(f"unknown backend {name!r}; expected one of {', '.join(LANE_NAMES)}")
    rep = probe_lane(name, device_index)
    if name != "cpu" and rep.state != "certified":
        raise BackendUnavailable(name, rep.reason)
    return rep


def environment() -> dict:
    """Platform, Python, ggml and toolchain facts for the JSON report."""
    runtime, load_error = installed.ggml_runtime()
    return {
        "platform": {"system": sys.platform, "machine": platform.machine(), "release": platform.release(),
                     "host": platform.node(), "python": platform.python_version()},
        "ggml": {
            "ggml_python": installed.ggml_python_version(),
            "ggml": runtime["version"] if runtime else None,
            "commit": runtime["commit"] if runtime else None,
            "lib_dir": str(installed.ggml_lib_dir()) if installed.ggml_lib_dir() else None,
            "lib_sha256": installed.lib_sha256(),
            "libraries": installed.installed_libraries(),
            "registry_backends": runtime["backends"] if runtime else None,
            "devices": runtime["devices"] if runtime else [],
            "cpu_features": runtime["cpu_features"] if runtime else None,
            "load_error": load_error,
        },
        "toolchain": toolchain.toolchain_versions(),
        "certifications_file": str(certifications.cache_dir() / certifications.CERT_FILE),
    }


# ---- entry points for scripts/build_ggml_lane.sh -------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    """``toolchain LANE``: print why LANE cannot be built here (:func:`meshnet.backends.toolchain.build_problem`) and exit 3, or exit 0.
    ``record LANE --cmake-args S --command S``: see :func:`meshnet.backends.installed.record_build`."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m meshnet.backends.lanes")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("toolchain")
    t.add_argument("lane", choices=LANE_NAMES)
    r = sub.add_parser("record")
    r.add_argument("lane", choices=LANE_NAMES)
    r.add_argument("--cmake-args", default="")
    r.add_argument("--command", default="")
    args = p.parse_args(argv)
    if args.cmd == "toolchain":
        problem = toolchain.build_problem(args.lane)
        if problem:
            print(problem)
            return 3
        return 0
    return installed.record_build(args.lane, args.cmake_args, args.command)


if __name__ == "__main__":
    sys.exit(main())
