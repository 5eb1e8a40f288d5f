"""slime.utils.misc: resolving `--*-path` flags ("package.module.function") to functions."""

from __future__ import annotations

import importlib
from typing import Any


def load_function(path: str) -> Any:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)
