"""MkDocs hooks (mkdocs.yml `hooks:`): the pages that must not drift from the code are generated or
checked at build time, so `mkdocs build --strict` fails when they would.

In a page's Markdown:
- `<!-- generated: settings -->`: the table of every setting, from service.config.Settings;
- `<!-- generated: metrics -->`: every Prometheus series the service defines (service.metrics,
  the remote env pools' series);
- `<!-- include: PATH -->`: a Markdown file of the repository (an example's README), its title
  dropped, its headings one level down, its relative links made repository links;
- `[text](repo:PATH)`: a link to a file or folder of the repository; the build fails if PATH does not
  exist. With `extra.repo_blob_url` set (`https://host/owner/repo/blob/main`), a link there; without,
  the path as code;
- `<!-- check: arrow-schema -->`: the page's table of columns (`` | `name` | `type` | ... ``) must
  list exactly service.api.arrow.ARROW_SCHEMA's columns, with their types.
Every `` `dir/.../name.ext` `` code span naming a file under one of the repository's top-level
folders must exist too (a renamed test, bench or module fails the build)."""

from __future__ import annotations

import ast
import posixpath
import re
import sys
import typing
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import Files
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the service's own definitions: Settings, Metrics, the Arrow schema
    sys.path.insert(0, str(ROOT))

REPO_FOLDERS = (
    "service",
    "client",
    "examples",
    "tests",
    "bench",
    "docker",
    "deploy",
    "scripts",
    "migrations",
)
REPO_LINK = re.compile(r"\[([^\]]+)\]\(repo:([^)\s#]+)(#[^)]*)?\)")
INCLUDE = re.compile(r"^<!-- include: (\S+) -->$", re.MULTILINE)
GENERATED = re.compile(r"^<!-- generated: (\w[\w-]*)(?: (\S+))? -->$", re.MULTILINE)
CODE_PATH = re.compile(rf"`((?:{'|'.join(REPO_FOLDERS)})/[\w./-]*)`")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
MARKDOWN_LINK = re.compile(r"(?<!!)\[([^\]]*)\]\(([^)\s]+)\)")


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    where = page.file.src_uri
    markdown = INCLUDE.sub(lambda match: include(match.group(1), where), markdown)
    markdown = GENERATED.sub(lambda match: generated(match.group(1), match.group(2), where), markdown)
    if "<!-- check: arrow-schema -->" in markdown:
        check_arrow_schema(markdown, where)
    check_code_paths(markdown, where)
    blob_url = str(config.extra.get("repo_blob_url") or "").rstrip("/")
    markdown = REPO_LINK.sub(lambda match: repo_link(match, blob_url, where), markdown)
    if "[OAD(" in page.file.content_string:  # the plugin's API reference, already in its own nesting
        return markdown
    return nest_lists(markdown)


def nest_lists(markdown: str) -> str:
    """The pages are written as GitHub reads them, a nested list 2 spaces in; Python-Markdown nests
    by 4. Every indentation is doubled, a fenced block's lines moved with its opening line."""
    lines = []
    fence: tuple[str, int] | None = None  # the open fence's marker and how far it moved
    for line in markdown.splitlines():
        stripped = line.lstrip(" ")
        indent = len(line) - len(stripped)
        if fence is not None:
            lines.append(" " * fence[1] + line if line.strip() else line)
            if stripped.startswith(fence[0]) and not stripped.strip("`~"):
                fence = None
            continue
        lines.append(" " * indent + line if stripped else line)
        if stripped.startswith(("```", "~~~")):
            fence = (stripped[:3], indent)
    return "\n".join(lines) + ("\n" if markdown.endswith("\n") else "")


# --- Repository paths ---------------------------------------------------------------------------------


def repo_path(path: str, where: str) -> Path:
    resolved = (ROOT / path).resolve()
    if ROOT not in resolved.parents and resolved != ROOT:
        raise PluginError(f"{where}: {path} is outside the repository")
    if not resolved.exists():
        raise PluginError(f"{where} names {path}, which is not in the repository")
    return resolved


def repo_link(match: re.Match[str], blob_url: str, where: str) -> str:
    text, path, anchor = match.group(1), match.group(2), match.group(3) or ""
    repo_path(path, where)
    if blob_url:
        return f"[{text}]({blob_url}/{path}{anchor})"
    if path.rstrip("/") in text.strip("`").rstrip("/") or text.strip("`") in path:
        return text if text.startswith("`") else f"`{text}`"
    return f"{text} (`{path}`)"


def check_code_paths(markdown: str, where: str) -> None:
    for path in CODE_PATH.findall(FENCE.sub("", markdown)):
        path = path.rstrip(".,")
        if "*" in path or "<" in path or "." not in posixpath.basename(path):
            continue  # a pattern, a placeholder, or a folder (another repository's, sometimes)
        repo_path(path, where)


def include(path: str, where: str) -> str:
    """A Markdown file of the repository as part of a page: its H1 dropped, headings one level down,
    its relative links (to files beside it) made repository links."""
    source = repo_path(path, where)
    text = source.read_text(encoding="utf-8")
    text = re.sub(r"\A# .*\n+", "", text)
    text = re.sub(r"^(#{1,5}) ", r"#\1 ", text, flags=re.MULTILINE)
    folder = posixpath.dirname(path)

    def relink(match: re.Match[str]) -> str:
        label, target = match.group(1), match.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            return match.group(0)
        target_path, _, anchor = target.partition("#")
        joined = posixpath.normpath(posixpath.join(folder, target_path))
        return f"[{label}](repo:{joined}{'#' + anchor if anchor else ''})"

    parts = re.split(r"(^```.*?^```)", text, flags=re.MULTILINE | re.DOTALL)
    return "".join(part if part.startswith("```") else MARKDOWN_LINK.sub(relink, part) for part in parts)


# --- Generated tables ---------------------------------------------------------------------------------


def generated(name: str, argument: str | None, where: str) -> str:
    if name == "bench-options" and argument:
        return bench_options(argument, where)
    if name == "settings":
        return settings_tables()
    if name == "metrics":
        return metrics_table()
    raise PluginError(f"{where}: no generated block named {name!r}")


def cell(text: str) -> str:
    """Text for a table cell: its code spans as they are, the rest with Markdown's and HTML's
    special characters escaped (a description's `<key>` or `USER_SIM_*` is text)."""
    parts = text.replace("\n", " ").split("`")
    for index in range(0, len(parts), 2):
        part = parts[index].replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        parts[index] = re.sub(r"([*_\\\[\]])", r"\\\1", part)
    return "`".join(parts).replace("|", "\\|")


def type_name(annotation: Any) -> str:
    if typing.get_origin(annotation) is typing.Literal:
        return " \\| ".join(f"`{value}`" for value in typing.get_args(annotation))
    args = typing.get_args(annotation)
    if args:
        return " or ".join(type_name(arg) for arg in args)
    name = getattr(annotation, "__name__", str(annotation))
    return {"SecretStr": "secret", "NoneType": "none", "str": "text"}.get(name, name)


def default_text(field: Any) -> str:
    from pydantic import SecretStr
    from pydantic_core import PydanticUndefined

    default = field.default
    if default is PydanticUndefined:
        return "(built)"
    if isinstance(default, SecretStr):
        default = default.get_secret_value()
    if hasattr(default, "value"):  # an enum
        default = default.value
    if isinstance(default, str) and default.startswith(str(ROOT)):
        default = Path(default).relative_to(ROOT).as_posix()
    if default == "":
        return "empty"
    if default is None:
        return "none"
    text = str(default).lower() if isinstance(default, bool) else str(default)
    if "\n" in text or len(text) > 60:
        return "*long text: see `service/config.py`*"
    return f"`{text}`".replace("|", "\\|")


def bounds(field: Any) -> str:
    found = []
    for item in field.metadata:
        for attribute, symbol in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            value = getattr(item, attribute, None)
            if value is not None:
                found.append(f"{symbol} {value}")
    return ", ".join(found)


def environment_variables(name: str, field: Any) -> list[str]:
    from pydantic import AliasChoices

    alias = field.validation_alias
    choices = alias.choices if isinstance(alias, AliasChoices) else [alias or name]
    return [str(choice).upper() for choice in choices]


def settings_rows(model: Any, skip: set[str]) -> list[str]:
    rows = ["| variable | type | default | |", "| --- | --- | --- | --- |"]
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        variables = " or ".join(f"`{variable}`" for variable in environment_variables(name, field))
        kind = type_name(field.annotation)
        limits = bounds(field)
        kind = f"{kind} ({limits})" if limits else kind
        rows.append(f"| {variables} | {kind} | {default_text(field)} | {cell(field.description or '')} |")
    return rows


def settings_tables() -> str:
    from service.config import Settings, UserSimSettings

    lines = settings_rows(Settings, skip={"user_sim"})
    user_sim = str(Settings.model_fields["user_sim"].description)
    lines += ["", "### The user simulator and the judge", "", user_sim]
    lines += ["", *settings_rows(UserSimSettings, skip=set())]
    return "\n".join(lines)


def metric_series() -> list[tuple[str, str, tuple[str, ...], str]]:
    """Every series of /metrics: (name, type, labels, help), the app's then the env pools'."""
    from prometheus_client.metrics import MetricWrapperBase

    from service.envs.remote.pool import SERIES
    from service.metrics import Metrics

    found = [value for value in vars(Metrics()).values() if isinstance(value, MetricWrapperBase)]
    series = [(c._name, c._type, tuple(c._labelnames), c._documentation) for c in found]
    return series + [(s.name, s.type, s.labels, s.documentation) for s in SERIES]


def metrics_table() -> str:
    rows = ["| series | type | labels | |", "| --- | --- | --- | --- |"]
    for name, kind, labelnames, documentation in metric_series():
        name += "_total" if kind == "counter" else ""
        labels = ", ".join(f"`{label}`" for label in labelnames) or ""
        rows.append(f"| `{name}` | {kind} | {labels} | {cell(documentation)} |")
    return "\n".join(rows)


def bench_options(script: str, where: str) -> str:
    """A bench's command-line options with their defaults and help, read from its argparse calls."""
    tree = ast.parse(repo_path(f"bench/{script}", where).read_text(encoding="utf-8"))
    options = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr != "add_argument" or not node.args or not isinstance(node.args[0], ast.Constant):
            continue
        flag = str(node.args[0].value)
        keywords = {keyword.arg: keyword.value for keyword in node.keywords}
        text = f"`{flag}`"
        if "default" in keywords and keywords.get("action") is None:
            text += f" (default `{ast.unparse(keywords['default'])}`)"
        if isinstance(keywords.get("help"), ast.Constant):
            text += f": {keywords['help'].value}"
        options.append(f"- {cell(text)}")
    return "Options:\n\n" + "\n".join(options) if options else "No options."


# --- Checked tables -----------------------------------------------------------------------------------


def check_arrow_schema(markdown: str, where: str) -> None:
    from service.api.arrow import ARROW_SCHEMA

    listed = dict(re.findall(r"^\| `(\w+)` \| `([^`]+)` \|", markdown, flags=re.MULTILINE))
    expected = {field.name: str(field.type) for field in ARROW_SCHEMA}
    if listed.keys() != expected.keys():
        missing = sorted(expected.keys() - listed.keys())
        extra = sorted(listed.keys() - expected.keys())
        raise PluginError(f"{where}: the Arrow columns listed drift from ARROW_SCHEMA: missing {missing}, "
                          f"not in the schema {extra}")  # fmt: skip
    wrong = {name: (listed[name], kind) for name, kind in expected.items() if listed[name] != kind}
    if wrong:
        raise PluginError(f"{where}: Arrow column types (listed, schema's): {wrong}")
