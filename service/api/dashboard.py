"""The web dashboard under ``/ui/``: a static shell (HTML, JS, CSS in ``service/api/ui/``) that reads the JSON API.
Its script is a set of ES modules loaded as they are (``<script type="module">``, no build step).

Authentication. A browser sends no ``Authorization`` header when it navigates to a page, so the pages here hold
no data and need no token: the shell asks for a token (a read token suffices), keeps it in the tab's
``sessionStorage`` (gone when the tab closes; never in a URL, never in a cookie) and calls ``/v1/...`` with
``Authorization: Bearer``, where the API checks it as for any client. When the controller runs without
``--tokens-file`` the API answers without a token and the shell says that authentication is off.

Every response here carries a strict Content-Security-Policy (everything from this origin only: no inline
script or style, no other host, no framing, no form submission), ``nosniff`` and ``no-referrer``. Only the files
named in :data:`ASSETS` are served; nothing is read from a path the request names.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from fastapi import APIRouter, HTTPException, Request, status
from fastapi.responses import JSONResponse, RedirectResponse, Response

import elastic
from service.core.config import Settings

__all__ = ["ASSETS", "ASSET_DIR", "SECURITY_HEADERS", "router"]

ASSET_DIR = Path(__file__).with_name("ui")

#: URL name under /ui/ -> (file in ASSET_DIR, media type)
ASSETS: dict[str, tuple[str, str]] = {
    "": ("index.html", "text/html; charset=utf-8"),
    # ES modules (no build step): dashboard.js is the entry the page loads, it imports the others
    **{
        name: (name, "text/javascript; charset=utf-8")
        for name in (
            "dashboard.js",
            "api.js",
            "dom.js",
            "shell.js",
            "charts.js",
            "jobs-view.js",
            "nodes-view.js",
            "job-view.js",
            "job-panels.js",
        )
    },
    "dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
    "favicon.svg": ("favicon.svg", "image/svg+xml"),
}

CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self'",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "frame-ancestors 'none'",
        "form-action 'none'",  # the token form is handled by script; a submission would put it in a URL
    ]
)

SECURITY_HEADERS: dict[str, str] = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cache-Control": "no-cache",
}

router = APIRouter(tags=["dashboard"], include_in_schema=False)


@lru_cache(maxsize=len(ASSETS))
def _read(filename: str) -> bytes | None:
    try:
        return (ASSET_DIR / filename).read_bytes()
    except OSError:
        return None


@router.get("/ui/config.json")
def dashboard_config(request: Request) -> JSONResponse:
    """What the shell needs before it calls the API: whether a token is required (a 401 says the same)."""
    settings: Settings = request.app.state.settings
    return JSONResponse(
        {"auth_required": settings.tokens is not None, "version": elastic.__version__}, headers=SECURITY_HEADERS
    )


@router.get("/ui")
def dashboard_redirect() -> RedirectResponse:
    # relative: behind an ingress that serves the controller under a path prefix, /prefix/ui -> /prefix/ui/
    return RedirectResponse("ui/", status_code=status.HTTP_308_PERMANENT_REDIRECT, headers=SECURITY_HEADERS)


@router.get("/ui/{name}")
@router.get("/ui/", name="dashboard_index")
def dashboard_asset(name: str = "") -> Response:
    asset = ASSETS.get(name)
    if asset is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail="no such dashboard file", headers=SECURITY_HEADERS)
    filename, media_type = asset
    body = _read(filename)
    if body is None:  # an installation without the package's data files
        raise HTTPException(
            status.HTTP_404_NOT_FOUND, detail=f"dashboard file {filename} is not installed", headers=SECURITY_HEADERS
        )
    return Response(body, media_type=media_type, headers=SECURITY_HEADERS)
