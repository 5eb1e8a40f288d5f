"""The API's contract, `openapi.yaml` at the top of the repository, generated from the app."""

from __future__ import annotations

import yaml

from service.app import create_app
from service.config import Settings


def openapi_yaml() -> str:
    app = create_app(Settings(run_worker=False))
    text: str = yaml.safe_dump(app.openapi(), sort_keys=False, allow_unicode=True, width=100)
    return text
