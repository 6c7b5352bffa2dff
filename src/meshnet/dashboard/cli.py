"""The dashboard's command-line options, shared by ``meshnet tracker`` and ``meshnet up`` (kept free of
FastAPI and uvicorn, which load only when a dashboard starts)."""

from __future__ import annotations

import argparse
import errno
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshnet.dashboard.server import Dashboard

DEFAULT_PORT = 7780


class _StoreGiven(argparse.Action):
    """Store the value and note that it was given (``<dest>_given``)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_given", True)


def add_dashboard_args(p: argparse.ArgumentParser, default_port: int = DEFAULT_PORT) -> None:
    """``--dashboard-port`` and ``--dashboard-host`` on the argparse parser ``p``."""
    from meshnet.arg_types import listen_host

    p.set_defaults(dashboard_port_given=False)
    p.add_argument("--dashboard-port", type=int, default=default_port, metavar="PORT", action=_StoreGiven,
                   help="serve the web dashboard (layer map, nodes, sessions, tokens/s, ledger) over HTTP on this "
                        "port (default %(default)s; 0 = any free port, -1 = no dashboard)")
    # An empty host listened on every interface (and printed http://:PORT/): refused, as --host '' is.
    p.add_argument("--dashboard-host", type=listen_host, default="127.0.0.1", metavar="HOST",
                   help="address the dashboard listens on (default %(default)s: this machine only; it needs no "
                        "join token, so expose it deliberately)")


def dashboard_port_problem(port: int) -> str | None:
    """None when ``port`` is a valid ``--dashboard-port``, else the error message to print."""
    if port == -1 or 0 <= port <= 65535:
        return None
    return f"--dashboard-port must be -1 (none) or in 0..65535, got {port}"


def dashboard_port_taken(args) -> str | None:
    """Why the dashboard could not listen where ``--dashboard-port`` was given explicitly (taken, or not
    an address of this machine), as the error to print, or None. Checked before anything starts: asked
    for by name, a dashboard that cannot start is an error; the default port taken (another tracker's
    dashboard on this machine) only costs this one its dashboard (:func:`dashboard_from_args`)."""
    from meshnet.wire.addresses import bind_problem, format_address

    port = args.dashboard_port
    if not args.dashboard_port_given or port <= 0 or (why := bind_problem(args.dashboard_host, port)) is None:
        return None
    return f"the dashboard cannot listen on {format_address(args.dashboard_host, port)} ({why}); {_advice(why)}"


def _advice(why: str) -> str:
    """What to change when the dashboard cannot listen, for the system's reason ``why``: the port when it
    is taken, else the host (a name that does not resolve, or not an address of this machine)."""
    if why == os.strerror(errno.EADDRINUSE):
        return "pass another --dashboard-port (0 = any free port, -1 = no dashboard)"
    return "pass a --dashboard-host that is an address of this machine (127.0.0.1, or 0.0.0.0 for all)"


def dashboard_from_args(service, args, who: str) -> "Dashboard | None":
    """Start the dashboard ``args`` ask for (checked with :func:`dashboard_port_problem` first; None with
    ``--dashboard-port -1``); when its port cannot be bound, say so on stderr (prefixed ``who``) and go on
    without it: the mesh matters more than its view."""
    if args.dashboard_port == -1:
        return None
    from meshnet.dashboard.server import start_dashboard
    from meshnet.wire.addresses import format_address, os_reason

    try:
        dashboard = start_dashboard(service, args.dashboard_host, args.dashboard_port)
    except (OSError, RuntimeError) as e:
        why = os_reason(e) if isinstance(e, OSError) else str(e)
        print(f"{who} no dashboard: cannot listen on {format_address(args.dashboard_host, args.dashboard_port)} "
              f"({why}); {_advice(why)}", file=sys.stderr, flush=True)
        return None
    print(f"{who} dashboard on {dashboard.url}", file=sys.stderr, flush=True)
    if (warning := open_dashboard_warning(args.dashboard_host, getattr(args, "join_token", None))) is not None:
        print(f"{who} WARNING: {warning}", file=sys.stderr, flush=True)
    return dashboard


def open_dashboard_warning(host: str, join_token: str | None) -> str | None:
    """What to warn of when a mesh closed by a join token shows its dashboard beyond this machine (the
    dashboard asks for no token), or None."""
    from meshnet.wire.addresses import is_loopback_host

    if not join_token or is_loopback_host(host):
        return None
    return (f"the dashboard on {host} asks for no join token: anyone who reaches its port sees the nodes' "
            "addresses, the sessions' routes and the ledger (--dashboard-host 127.0.0.1 keeps it to this "
            "machine; -1 as --dashboard-port serves none)")
