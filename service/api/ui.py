"""Pages for people, served from the package with nothing from a CDN (training clusters are often
offline): the trajectory viewer at /ui/ (plain HTML, CSS and JavaScript in service/assets/ui) and
the API docs at /docs (Swagger UI's files from the swagger-ui-bundle-v2 package)."""

from __future__ import annotations

from pathlib import Path

import swagger_ui_bundle
from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

UI_DIR = Path(__file__).resolve().parents[1] / "assets" / "ui"
DOCS_ASSETS = "/docs/assets"


def install_pages(app: FastAPI) -> None:
    """The app must be created with docs_url=None and redoc_url=None (FastAPI's load from a CDN)."""
    app.mount("/ui", StaticFiles(directory=UI_DIR, html=True), name="ui")
    app.mount(DOCS_ASSETS, StaticFiles(directory=swagger_ui_bundle.swagger_ui_path), name="docs-assets")

    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse("/ui/")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title=f"{app.title} - API docs",
            oauth2_redirect_url="/docs/oauth2-redirect",
            swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{DOCS_ASSETS}/favicon-32x32.png",
            swagger_ui_parameters={"persistAuthorization": False},
        )

    @app.get("/docs/oauth2-redirect", include_in_schema=False)
    async def oauth2_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()
