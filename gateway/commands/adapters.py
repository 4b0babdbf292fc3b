"""`tiergate adapters add|list|share|pin|unpin|remove`: LoRA adapters, through a replica's
admin API.

Adapters are checked against the model a replica serves before they are stored, so these
commands talk to a running replica (--url, the admin token in TIERGATE_ADMIN_TOKEN) rather
than to the database. `add DIR` uploads the directory's adapter_config.json and
adapter_model.safetensors as an archive; with --server-path the replica reads DIR itself.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from gateway.admin.auth import ADMIN_TOKEN_ENV
from gateway.commands.tenants import print_table

_URL_ENV = "TIERGATE_URL"
_COLUMNS = ("id", "name", "base_model", "owner_tenant_id", "shared_with", "rank", "size_bytes",
            "pinned", "created_at")
_FILES = ("adapter_config.json", "adapter_model.safetensors")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    group = subparsers.add_parser("adapters", help="register, list, share, remove LoRA adapters")
    commands = group.add_subparsers(dest="adapters_command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=os.environ.get(_URL_ENV, "http://127.0.0.1:8000"),
                        help=f"a replica's base URL (default: ${_URL_ENV}, else "
                             "http://127.0.0.1:8000)")
    common.add_argument("--json", action="store_true", help="print JSON for scripts")

    add = commands.add_parser("add", parents=[common], help="register an adapter")
    add.add_argument("directory", type=Path, help="a PEFT LoRA adapter directory")
    add.add_argument("--name", required=True, help="the name requests send as their model")
    add.add_argument("--owner", required=True, help="the owning tenant (id or name)")
    add.add_argument("--share", default="", help="other tenants that may use it (comma list)")
    add.add_argument("--base-model", default=None,
                     help="the served model it is for (needed where the server serves several)")
    add.add_argument("--server-path", action="store_true",
                     help="the replica reads the directory itself instead of an upload")
    add.set_defaults(func=_add)

    listing = commands.add_parser("list", parents=[common], help="list adapters")
    listing.add_argument("--owner", help="only those this tenant owns or was granted")
    listing.set_defaults(func=_list)

    share = commands.add_parser("share", parents=[common],
                                help="set the tenants besides the owner that may use it")
    share.add_argument("name")
    share.add_argument("--with", dest="tenants", default="", help="tenants (comma list)")
    share.set_defaults(func=_share)

    for verb, pinned in (("pin", True), ("unpin", False)):
        pin = commands.add_parser(
            verb, parents=[common],
            help="keep it in the engines' host caches once loaded" if pinned
            else "leave it to the host caches' LRU again")
        pin.add_argument("name")
        pin.set_defaults(func=_pinner(pinned))

    remove = commands.add_parser("remove", parents=[common],
                                 help="unregister (waits for its running requests)")
    remove.add_argument("name")
    remove.set_defaults(func=_remove)


def _client(args: argparse.Namespace) -> httpx.Client:
    token = os.environ.get(ADMIN_TOKEN_ENV, "")
    return httpx.Client(base_url=f"{args.url.rstrip('/')}/admin/v1",
                        headers={"x-admin-token": token}, timeout=600)


def _call(args: argparse.Namespace, method: str, path: str, **kwargs: Any) -> int:
    """One admin API call; prints its result, or its error on stderr (exit status 1)."""
    try:
        with _client(args) as client:
            response = client.request(method, path, **kwargs)
    except httpx.HTTPError as exc:
        print(f"tiergate: error: {args.url}: {exc}", file=sys.stderr)
        return 1
    body = response.json() if response.content else {}
    if response.status_code >= 400:
        message = body.get("error", {}).get("message", response.text)
        print(f"tiergate: error: {message}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(body, indent=2))
    elif isinstance(body.get("data"), list):
        print_table(body["data"], _COLUMNS)
    else:
        print_table([body], _COLUMNS)
    if response.status_code == 202:
        print("requests still run on it: it takes no new ones; run remove again to finish",
              file=sys.stderr)
    return 0


def _add(args: argparse.Namespace) -> int:
    shared = [ref for ref in args.share.split(",") if ref]
    base = {} if args.base_model is None else {"base_model": args.base_model}
    if args.server_path:
        return _call(args, "POST", "/adapters", json={
            "name": args.name, "owner": args.owner, "shared_with": shared,
            "path": str(args.directory.resolve()), **base})
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w:gz") as tar:
        for name in _FILES:
            path = args.directory / name
            if not path.is_file():
                print(f"tiergate: error: {path} is missing", file=sys.stderr)
                return 1
            tar.add(path, arcname=name)
    return _call(args, "POST", "/adapters", content=archive.getvalue(),
                 params={"name": args.name, "owner": args.owner, "shared_with": ",".join(shared),
                         **base},
                 headers={"content-type": "application/gzip"})


def _list(args: argparse.Namespace) -> int:
    return _call(args, "GET", "/adapters", params={"owner": args.owner} if args.owner else None)


def _share(args: argparse.Namespace) -> int:
    shared = [ref for ref in args.tenants.split(",") if ref]
    return _call(args, "PATCH", f"/adapters/{args.name}", json={"shared_with": shared})


def _pinner(pinned: bool) -> Callable[[argparse.Namespace], int]:
    def pin(args: argparse.Namespace) -> int:
        return _call(args, "PATCH", f"/adapters/{args.name}", json={"pinned": pinned})

    return pin


def _remove(args: argparse.Namespace) -> int:
    return _call(args, "DELETE", f"/adapters/{args.name}")
