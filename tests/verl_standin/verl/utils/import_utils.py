"""verl.utils.import_utils.load_class_from_fqn, as verl has it."""

from __future__ import annotations

import importlib
from typing import Any


def load_class_from_fqn(fqn: str, description: str = "class") -> Any:
    if "." not in fqn:
        raise ValueError(f"Invalid {description} path: '{fqn}'. Expected format: 'module.path.ClassName'")
    module_path, class_name = fqn.rsplit(".", 1)
    module = importlib.import_module(module_path)
    return getattr(module, class_name)
