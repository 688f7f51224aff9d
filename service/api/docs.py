"""The API's interactive docs at ``/docs``: Swagger UI served by the controller itself, from the installed package
``swagger-ui-bundle-v2`` (its files, Apache-2.0), never from a CDN.

``/docs`` shares its origin with the dashboard (``/ui/``), whose tab keeps the API token in ``sessionStorage``: any
script that runs on this origin can read it. FastAPI's default page loads Swagger UI from a CDN without integrity
hashes and sends no Content-Security-Policy, so whoever controls that CDN (or the path to it) could read the token.
Here every file comes from this origin and every response carries a CSP that runs script from this origin only (no
inline script: the page's own set-up is the file ``/docs/init.js``), talks to this origin only, and may not be
framed; ReDoc (``/redoc``, also from a CDN) is off. Only the files named in :data:`ASSETS` are served.

Without the package (an installation without the ``service`` extras) ``/docs`` says so, and ``/openapi.json`` still
serves the API's description.
"""

from __future__ import annotations

import importlib
import logging
from functools import lru_cache
from pathlib import Path

from fastapi import APIRouter, HTTPException, status
from fastapi.responses import FileResponse, HTMLResponse, Response

from service.api.dashboard import SECURITY_HEADERS

logger = logging.getLogger(__name__)

__all__ = ["ASSETS", "DOCS_CSP", "DOCS_HEADERS", "router", "swagger_ui_dir"]

#: URL name under /docs/ -> media type: the Swagger UI files served (from :func:`swagger_ui_dir`)
ASSETS: dict[str, str] = {
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui.css": "text/css; charset=utf-8",
    "favicon-32x32.png": "image/png",
}

DOCS_CSP = "; ".join(
    [
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",  # (React sets element styles through the DOM, which a CSP does not govern)
        "img-src 'self' data:",  # Swagger UI's icons are data: URLs in its stylesheet
        "font-src 'self'",
        "connect-src 'self'",  # the API description and "Try it out" requests: this origin only
        "object-src 'none'",
        "base-uri 'none'",
        "frame-ancestors 'none'",
        "form-action 'none'",
    ]
)

#: the headers of every /docs response: the dashboard's, with the docs' own CSP
DOCS_HEADERS: dict[str, str] = {**SECURITY_HEADERS, "Content-Security-Policy": DOCS_CSP}

# relative URLs: /docs -> /docs/..., and behind an ingress that serves the controller under /prefix,
# /prefix/docs -> /prefix/docs/... and /prefix/openapi.json
_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>etrain API</title>
<link rel="stylesheet" href="docs/swagger-ui.css">
<link rel="icon" type="image/png" href="docs/favicon-32x32.png">
</head>
<body>
<div id="swagger-ui"></div>
<script src="docs/swagger-ui-bundle.js"></script>
<script src="docs/init.js"></script>
</body>
</html>
"""

_INIT = """"use strict";
// Swagger UI on the API's own description; validatorUrl null: the page sends nothing to swagger.io
window.ui = SwaggerUIBundle({
  url: new URL("openapi.json", document.baseURI).href,
  dom_id: "#swagger-ui",
  deepLinking: true,
  validatorUrl: null,
  presets: [SwaggerUIBundle.presets.apis],
  layout: "BaseLayout",
});
"""

_MISSING = """<!DOCTYPE html>
<html lang="en">
<head><meta charset="utf-8"><title>etrain API</title></head>
<body>
<p>Swagger UI is not installed with this controller (the package swagger-ui-bundle-v2, part of the service extras:
<code>pip install "elastic-train[service]"</code>). The API's description is at <a href="openapi.json">openapi.json</a>.
</p>
</body>
</html>
"""

router = APIRouter(tags=["docs"], include_in_schema=False)


@lru_cache(maxsize=1)
def swagger_ui_dir() -> Path | None:
    """The directory of the installed Swagger UI files, or None without the package."""
    try:
        module = importlib.import_module("swagger_ui_bundle")
    except ImportError:
        logger.warning("swagger-ui-bundle-v2 is not installed: /docs shows no Swagger UI")
        return None
    path = getattr(module, "swagger_ui_path", None)
    return None if path is None else Path(str(path))


@router.get("/docs")
def docs_page() -> HTMLResponse:
    page = _PAGE if swagger_ui_dir() is not None else _MISSING
    return HTMLResponse(page, headers=DOCS_HEADERS)


@router.get("/docs/init.js")
def docs_init() -> Response:
    return Response(_INIT, media_type="text/javascript; charset=utf-8", headers=DOCS_HEADERS)


@router.get("/docs/{name}")
def docs_asset(name: str) -> FileResponse:
    media_type = ASSETS.get(name)
    folder = swagger_ui_dir()
    if media_type is None or folder is None or not (folder / name).is_file():
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail="no such docs file", headers=DOCS_HEADERS)
    return FileResponse(folder / name, media_type=media_type, headers=DOCS_HEADERS)
