"""The admin console routes: the page and its assets, content types, cache validators, the
Content-Security-Policy, the static rules the CSP relies on (no inline script or style,
nothing loaded from another origin, every module import resolvable), and every view of the
page routed and linked from the nav."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from gateway.admin.console_routes import CONSOLE_CSP, CONSOLE_DIR, console_routes
from gateway.http.errors import exception_handlers

ASSETS = sorted(p.name for p in CONSOLE_DIR.iterdir() if p.name != "index.html")
EXPECTED_TYPES = {
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
# The one absolute URL the scripts may contain: the SVG namespace, an identifier never fetched.
SVG_NAMESPACE = "http://www.w3.org/2000/svg"


@pytest.fixture
def console() -> TestClient:
    app = Starlette(routes=console_routes(), exception_handlers=exception_handlers())
    return TestClient(app)


def _csp_directives(header: str) -> dict[str, list[str]]:
    directives = {}
    for part in header.split(";"):
        name, *values = part.split()
        directives[name] = values
    return directives


def test_the_page_is_served_at_admin_with_a_strict_csp(console: TestClient) -> None:
    for path in ("/admin", "/admin/"):
        response = console.get(path)
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/html; charset=utf-8"
        assert response.content == (CONSOLE_DIR / "index.html").read_bytes()
        assert response.headers["content-security-policy"] == CONSOLE_CSP
        assert response.headers["x-content-type-options"] == "nosniff"
        assert response.headers["x-frame-options"] == "DENY"
        assert response.headers["cache-control"] == "no-cache"
    directives = _csp_directives(CONSOLE_CSP)
    assert directives["default-src"] == ["'none'"]
    assert directives["script-src"] == ["'self'"]
    assert directives["style-src"] == ["'self'"]
    assert directives["connect-src"] == ["'self'"]
    assert directives["frame-ancestors"] == ["'none'"]
    assert "unsafe" not in CONSOLE_CSP


@pytest.mark.parametrize("name", ASSETS)
def test_each_asset_has_its_content_type_csp_and_etag(console: TestClient, name: str) -> None:
    response = console.get(f"/admin/assets/{name}")
    assert response.status_code == 200
    assert response.headers["content-type"] == EXPECTED_TYPES[Path(name).suffix]
    assert response.content == (CONSOLE_DIR / name).read_bytes()
    assert response.headers["content-security-policy"] == CONSOLE_CSP
    assert re.fullmatch(r'"[0-9a-f]{32}"', response.headers["etag"])


def test_a_matching_etag_gets_304_without_a_body(console: TestClient) -> None:
    etag = console.get("/admin/assets/console.js").headers["etag"]
    for validator in (etag, f"W/{etag}", f'"other", {etag}', "*"):
        response = console.get("/admin/assets/console.js", headers={"if-none-match": validator})
        assert response.status_code == 304, validator
        assert response.content == b""
        assert response.headers["etag"] == etag
    stale = console.get("/admin/assets/console.js", headers={"if-none-match": '"stale"'})
    assert stale.status_code == 200
    assert stale.content


def test_head_answers_without_a_body(console: TestClient) -> None:
    response = console.head("/admin")
    assert response.status_code == 200
    assert response.content == b""
    assert response.headers["content-security-policy"] == CONSOLE_CSP


@pytest.mark.parametrize(
    "path",
    [
        "/admin/assets/missing.js",
        "/admin/assets/index.html",  # the page lives at /admin only
        "/admin/assets/%2e%2e%2fconsole_routes.py",
        "/admin/assets/..%2F..%2Fpyproject.toml",
    ],
)
def test_unknown_assets_are_openai_shaped_404s(console: TestClient, path: str) -> None:
    response = console.get(path)
    assert response.status_code == 404
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "not_found_error"


def test_only_known_suffixes_are_served(tmp_path: Path) -> None:
    (tmp_path / "index.html").write_text("<!doctype html><title>t</title>")
    (tmp_path / "notes.txt").write_text("not an asset")
    (tmp_path / "app.js").write_text("export {};")
    app = Starlette(routes=console_routes(tmp_path), exception_handlers=exception_handlers())
    console = TestClient(app)
    assert console.get("/admin/assets/app.js").status_code == 200
    assert console.get("/admin/assets/notes.txt").status_code == 404


def test_a_console_without_its_page_fails_at_start_up(tmp_path: Path) -> None:
    (tmp_path / "app.js").write_text("export {};")
    with pytest.raises(FileNotFoundError, match=r"index\.html"):
        console_routes(tmp_path)


class _PageParser(HTMLParser):
    """Collects what the CSP must allow: scripts, styles, inline handlers, references."""

    def __init__(self) -> None:
        super().__init__()
        self.scripts: list[dict[str, str | None]] = []
        self.inline_code: list[str] = []
        self.references: list[str] = []
        self.labels_for: set[str] = set()
        self.fields: list[dict[str, str | None]] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        if tag == "script":
            self.scripts.append(attributes)
            self._in_script = True
        if tag == "style":
            self.inline_code.append("<style>")
        for name, _value in attrs:
            if name == "style" or name.startswith("on"):
                self.inline_code.append(f"{tag} {name}=")
        for name in ("src", "href"):
            value = attributes.get(name)
            if value and not value.startswith("#"):
                self.references.append(value)
        if tag == "label" and attributes.get("for"):
            self.labels_for.add(str(attributes["for"]))
        if tag in ("input", "select", "textarea"):
            self.fields.append(attributes)

    def handle_endtag(self, tag: str) -> None:
        if tag == "script":
            self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script and data.strip():
            self.inline_code.append(f"inline script: {data.strip()[:40]}")


def _page() -> _PageParser:
    parser = _PageParser()
    parser.feed((CONSOLE_DIR / "index.html").read_text())
    return parser


def test_the_page_has_no_inline_code_and_loads_only_bundled_assets() -> None:
    page = _page()
    assert page.inline_code == []
    assert page.scripts == [{"type": "module", "src": "/admin/assets/console.js"}]
    assert page.references, "the page references its assets"
    for reference in page.references:
        assert reference.startswith("/admin/assets/"), reference
        assert reference.removeprefix("/admin/assets/") in ASSETS, reference


def test_every_form_field_of_the_page_has_a_label() -> None:
    page = _page()
    assert page.fields
    for field in page.fields:
        assert field.get("id") in page.labels_for, field


@pytest.mark.parametrize("name", [n for n in ASSETS if n.endswith(".js")])
def test_scripts_import_only_bundled_modules_and_never_write_markup(name: str) -> None:
    source = (CONSOLE_DIR / name).read_text()
    imports = re.findall(r'\bfrom "([^"]+)";$', source, flags=re.MULTILINE)
    assert "import(" not in source, "dynamic imports"
    for specifier in imports:
        assert specifier.startswith("./"), specifier
        assert specifier.removeprefix("./") in ASSETS, specifier
    assert re.findall(r"https?://[^\s\"'`]+", source) in ([], [SVG_NAMESPACE])
    # Markup built from strings could carry data as code; the DOM helpers set text only.
    for forbidden in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert forbidden not in source, forbidden
    assert 'setAttribute("style"' not in source


def test_stylesheet_loads_nothing_from_elsewhere() -> None:
    css = (CONSOLE_DIR / "console.css").read_text()
    assert "@import" not in css
    assert "url(" not in css


class _ViewsParser(HTMLParser):
    """The page's views (section.view ids) and its nav links' views."""

    def __init__(self) -> None:
        super().__init__()
        self.sections: set[str] = set()
        self.nav_views: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        if tag == "section" and "view" in (attributes.get("class") or "").split():
            self.sections.add(str(attributes["id"]).removeprefix("view-"))
        if tag == "a" and attributes.get("data-view"):
            self.nav_views.append(str(attributes["data-view"]))


def test_every_view_has_a_section_a_route_and_the_nav_links_to_them() -> None:
    views = _ViewsParser()
    views.feed((CONSOLE_DIR / "index.html").read_text())
    router = (CONSOLE_DIR / "console.js").read_text()
    block = re.search(r"const VIEWS = \{(.*?)\};", router, flags=re.DOTALL)
    assert block, "console.js has no VIEWS table"
    routed = set(re.findall(r"^\s*(\w+): \w+View,$", block.group(1), flags=re.MULTILINE))
    assert routed == views.sections - {"signin"}
    assert "adapters" in views.nav_views
    assert set(views.nav_views) <= routed

