"""The admin console at /admin: a static page and its assets, bundled with the package.

The page holds no data: everything it shows comes from the admin API (/admin/v1), which it
calls with the admin token from the browser's sessionStorage. So these routes need no token,
but they answer with a strict Content-Security-Policy: scripts only from this origin and no
inline ones, no connections elsewhere, no framing. The assets are plain files (no build
step) read once when the routes are built, each with a content hash as its ETag; browsers
revalidate them on every load (``no-cache``), which costs a 304 and never serves a stale
console after an upgrade.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from gateway.http.errors import NotFoundError

__all__ = ["CONSOLE_CSP", "CONSOLE_DIR", "console_routes"]

CONSOLE_DIR = Path(__file__).parent / "console"
_INDEX_FILE = "index.html"

CONSOLE_CSP = "; ".join(
    [
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self'",
        "connect-src 'self'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ]
)

_CONTENT_TYPES: dict[str, str] = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}

_SECURITY_HEADERS: dict[str, str] = {
    "content-security-policy": CONSOLE_CSP,
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}


@dataclass(frozen=True)
class _Asset:
    """One console file, held in memory (they are a few kilobytes each)."""

    # The file's bytes as served.
    body: bytes
    # The Content-Type header value, from the file's suffix.
    content_type: str
    # A strong validator: the quoted start of the body's SHA-256.
    etag: str


def console_routes(console_dir: Path = CONSOLE_DIR) -> list[BaseRoute]:
    """GET /admin (the page) and GET /admin/assets/{file} (its scripts, styles and icon)."""
    assets = _load_assets(console_dir)
    index = assets.pop(_INDEX_FILE)

    async def page(request: Request) -> Response:
        return _serve(request, index)

    async def asset(request: Request) -> Response:
        name: str = request.path_params["file"]
        found = assets.get(name)
        if found is None:
            raise NotFoundError(f"no console asset named {name!r}", code="not_found")
        return _serve(request, found)

    return [
        Route("/admin", page, methods=["GET"]),
        Route("/admin/", page, methods=["GET"]),
        Route("/admin/assets/{file}", asset, methods=["GET"]),
    ]


def _load_assets(console_dir: Path) -> dict[str, _Asset]:
    """Every servable file of console_dir by name; other suffixes are never served."""
    assets: dict[str, _Asset] = {}
    for path in sorted(console_dir.iterdir()):
        content_type = _CONTENT_TYPES.get(path.suffix)
        if content_type is None or not path.is_file():
            continue
        body = path.read_bytes()
        etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
        assets[path.name] = _Asset(body, content_type, etag)
    if _INDEX_FILE not in assets:
        raise FileNotFoundError(f"console page {console_dir / _INDEX_FILE} is missing")
    return assets


def _serve(request: Request, asset: _Asset) -> Response:
    headers = {**_SECURITY_HEADERS, "etag": asset.etag}
    if _matches(request.headers.get("if-none-match"), asset.etag):
        return Response(status_code=304, headers=headers)
    return Response(asset.body, media_type=asset.content_type, headers=headers)


def _matches(if_none_match: str | None, etag: str) -> bool:
    """If-None-Match uses the weak comparison: W/"x" matches "x", and * matches anything."""
    if not if_none_match:
        return False
    tags = {tag.strip().removeprefix("W/") for tag in if_none_match.split(",")}
    return "*" in tags or etag in tags
