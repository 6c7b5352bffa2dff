"""``meshnet backends [--json] [--certify]``: every lane's state on this machine, with exact reasons.

Without ``--certify`` nothing runs but the lane probes (vendor tools such as ``nvidia-smi -L``); with it,
the CPU lane and every accelerator lane that is built and has a device run their self-test first, and
lanes that cannot run are reported skipped with the reason, never as passed.

Exit status: 0; 1 when ``--certify`` ran a self-test that failed; 2 for a bad model, or a self-test flag
(``--lane``, ``--model``, ``--threads``) without ``--certify``.
Also runnable as ``python -m meshnet.backends.cli``.
"""

from __future__ import annotations

import argparse
import json
import sys

from meshnet.arg_types import thread_count
from meshnet.backends import LANE_NAMES

# CPU threads of the self-test when --threads is not given.
SELF_TEST_THREADS = 2


def add_backends_parser(sub) -> None:
    """Add the ``backends`` subcommand to an ``argparse`` subparsers object."""
    p = sub.add_parser("backends", help="report the CPU/CUDA/ROCm/Vulkan/Metal lanes: available, built, "
                                        "certified or skipped, with the reason")
    _add_args(p)
    p.set_defaults(func=cmd_backends)


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--certify", action="store_true",
                   help="run the self-test of every lane that can run here first, and record the results")
    p.add_argument("--lane", action="append", choices=LANE_NAMES, default=None,
                   help="with --certify: only these lanes (repeatable; default all)")
    p.add_argument("--model", default=None,
                   help="GGUF path or bundled name for the self-test (default: the golden tiny llama when "
                        "../shared/golden is present, else smollm2)")
    # None: not given (SELF_TEST_THREADS), so that one given without --certify is refused, not ignored.
    p.add_argument("--threads", type=thread_count, default=None,
                   help=f"with --certify: CPU threads for the self-test (default {SELF_TEST_THREADS})")
    p.add_argument("--device", type=int, default=0, metavar="N",
                   help="which device of each accelerator lane to test and report (ggml's order; default 0)")


def _certify_problem(args: argparse.Namespace) -> str | None:
    """Why flags that set the self-test were given without ``--certify`` (which alone runs it: they were
    accepted and ignored), or None."""
    if args.certify:
        return None
    given = next((flag for flag, value in (("--lane", args.lane), ("--model", args.model),
                                           ("--threads", args.threads)) if value is not None), None)
    return given and (f"{given} needs --certify (it sets the self-test, which only --certify runs); add "
                      f"--certify or drop {given}")


def backends_report(certify: bool = False, lanes: list[str] | None = None, model: str | None = None,
                    threads: int = SELF_TEST_THREADS, device_index: int = 0) -> dict:
    """The report ``meshnet backends --json`` prints.

    Returns:
        ``{"environment": {...}, "goldens": {...} or None, "lanes": [LaneReport.to_dict(), ...] (all five, table order),
        "certified": [lane, ...], "advertisable": [lane, ...], "self_tests": [CertResult.to_dict(), ...]}``.
        ``advertisable`` is what a node may register with a tracker: cpu plus certified accelerators.
        ``goldens`` says which llama.cpp golden set holds for the CPU kernels here (``{"set", "directory",
        "exact", "rule"}``; ``set`` None without a golden folder); None when ggml does not load.
    """
    from meshnet.backends import lanes as lanes_mod

    tests = []
    if certify:
        from meshnet.backends.certify import certify as run_certify

        for name in lanes or LANE_NAMES:
            index = 0 if name == "cpu" else device_index
            tests.append(run_certify(name, model, n_threads=threads, device_index=index).to_dict())
    reports = [r.to_dict() for r in lanes_mod.probe_all(device_index)]
    certified = [r["lane"] for r in reports if r["state"] == "certified"]
    env = lanes_mod.environment()
    return {
        "environment": env,
        "goldens": _golden_report() if env["ggml"]["cpu_features"] is not None else None,
        "lanes": reports,
        "certified": certified,
        "advertisable": ["cpu"] + [n for n in certified if n != "cpu"],
        "self_tests": tests,
    }


def _golden_report() -> dict:
    from meshnet.backends.golden_sets import running_golden_set

    gs = running_golden_set()
    if gs is None:
        return {"set": None, "directory": None, "exact": False, "rule": "no golden folder here"}
    return {"set": gs.name, "directory": str(gs.directory), "exact": gs.exact, "rule": gs.rule}


def format_table(report: dict) -> str:
    env = report["environment"]
    g = env["ggml"]
    lines = [f"ggml-python {g['ggml_python']} (ggml {g['ggml']}), {env['platform']['system']} "
             f"{env['platform']['machine']}, registry: {', '.join(g['registry_backends'] or []) or 'not loadable'}"]
    if g.get("cpu_features") is not None:
        lines.append(f"CPU kernels compiled for: {' '.join(g['cpu_features']) or 'no SIMD features'}")
    if report.get("goldens"):
        lines.append(f"llama.cpp goldens: {report['goldens']['rule']}")
    width = max(len(n) for n in LANE_NAMES)
    for r in report["lanes"]:
        lines.append(f"{r['lane']:<{width}}  {r['state']:<9}  {r['reason']}")
    lines.append(f"advertisable to a tracker: {', '.join(report['advertisable'])}")
    return "\n".join(lines)


def cmd_backends(args: argparse.Namespace) -> int:
    from meshnet.model.bundled import ModelNotFound

    if args.device < 0:
        print(f"error: --device must be 0 or more, got {args.device}", file=sys.stderr)
        return 2
    if problem := _certify_problem(args):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    threads = SELF_TEST_THREADS if args.threads is None else args.threads
    try:
        report = backends_report(args.certify, args.lane, args.model, threads, args.device)
    except (ModelNotFound, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(format_table(report))
        for t in report["self_tests"]:
            print(f"self-test {t['lane']}: {t['state']}: {t['reason']}", file=sys.stderr)
    return 1 if any(t["state"] == "failed" for t in report["self_tests"]) else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="meshnet backends", description=__doc__.splitlines()[0])
    _add_args(p)
    return cmd_backends(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
