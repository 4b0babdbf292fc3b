"""`tiergate serve`: run one replica (gateway + engine) until SIGTERM, then drain and exit 0.

Start-up order: settings, Alembic upgrade head (unless --no-migrate), the demo tenant on an
empty database, then the HTTP server; the model loads in the background and /health/ready
turns 200 once it is loaded. SIGTERM or Ctrl-C: new requests get 503, requests in flight
finish (up to --drain-timeout), the ledger is flushed, exit 0. A second signal stops waiting:
the requests in flight end at once and are recorded, the ledger is flushed, exit 0.
"""

from __future__ import annotations

import argparse
import logging
import sys

from gateway.server.settings import add_arguments

logger = logging.getLogger("tiergate.serve")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve the OpenAI-compatible API (demo model unless --model)",
        description="Serve /v1/chat/completions, /v1/completions and /v1/models. Every flag "
        "has a TIERGATE_* environment variable; the admin token is read only from "
        "TIERGATE_ADMIN_TOKEN.",
    )
    add_arguments(parser)
    parser.add_argument("--log-level", default="info", help="debug, info, warning, error")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    # Heavy imports here, not at module level: every `tiergate` command imports this module.
    from gateway.server.serve import ServeError, serve
    from gateway.server.settings import GatewaySettings, SettingsError

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        settings = GatewaySettings.from_sources(args)
    except SettingsError as exc:
        print(f"tiergate serve: {exc}", file=sys.stderr)
        return 2
    try:
        return serve(settings, log_level=args.log_level)
    except ServeError as exc:
        print(f"tiergate serve: {exc}", file=sys.stderr)
        return 1
