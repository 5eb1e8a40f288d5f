"""Print the service's runtime requirements (plus any extras) from pyproject.toml, one per line.

Used by docker/Dockerfile to install the dependencies in their own cached layer, before the
source is copied: only pyproject.toml invalidates that layer.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from pathlib import Path


def requirements(pyproject: Path, extras: list[str]) -> list[str]:
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [extra for extra in extras if extra not in optional]
    if unknown:
        raise SystemExit(f"unknown extras {unknown}; pyproject.toml defines {sorted(optional)}")
    return [*project["dependencies"], *(req for extra in extras for req in optional[extra])]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("pyproject", type=Path)
    parser.add_argument("--extras", default="", help="comma-separated extras, e.g. 'tau'")
    args = parser.parse_args(argv)
    extras = [extra.strip() for extra in args.extras.split(",") if extra.strip()]
    sys.stdout.write("".join(f"{req}\n" for req in requirements(args.pyproject, extras)))


if __name__ == "__main__":
    main()
