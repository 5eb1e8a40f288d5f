"""The documentation site (mkdocs.yml, docs/) builds in strict mode, and what it says cannot drift
from the code: every page is in the navigation, a broken link fails the build, the settings page
lists every setting, the API page every operation of openapi.yaml, the client's reference its public
API, the Arrow page every column, the benchmarks page every bench; no page loads anything from
another host; the README stays a short front page whose links resolve."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import rollout_client
import yaml
from mkdocs.exceptions import PluginError

from service.api.arrow import ARROW_SCHEMA
from service.config import environment_names

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
CONFIG = ROOT / "mkdocs.yml"
HTTP_METHODS = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config)]
    command += ["--site-dir", str(site)]
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    built = tmp_path_factory.mktemp("site")
    result = mkdocs_build(CONFIG, built)
    assert result.returncode == 0, result.stdout + result.stderr
    yield built


def page_html(site: Path, page: str) -> str:
    """The built HTML of docs/<page>.md."""
    path = site / page.removesuffix(".md").removesuffix("index") / "index.html"
    return path.read_text(encoding="utf-8")


def nav_pages(items: object) -> Iterator[str]:
    if isinstance(items, str):
        yield items
    elif isinstance(items, list):
        for item in items:
            yield from nav_pages(item)
    elif isinstance(items, dict):
        for value in items.values():
            yield from nav_pages(value)


def config() -> dict[str, object]:
    loaded: dict[str, object] = yaml.safe_load(CONFIG.read_text(encoding="utf-8"))
    return loaded


def test_the_site_builds_in_strict_mode(site: Path) -> None:
    assert (site / "index.html").exists()
    assert (site / "search" / "search_index.json").exists()


def test_every_page_is_in_the_navigation() -> None:
    pages = {path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md")}
    listed = set(nav_pages(config()["nav"]))
    assert pages == listed, f"not in the nav: {sorted(pages - listed)}; not a page: {sorted(listed - pages)}"


def broken_copy(tmp_path: Path, page: str, broken: str) -> Path:
    """mkdocs.yml and docs/ copied, with `broken` appended to `page`; the hooks, the client and
    openapi.yaml those of the repository."""
    docs = tmp_path / "docs"
    shutil.copytree(DOCS, docs)
    with (docs / page).open("a", encoding="utf-8") as file:
        file.write(f"\n\n{broken}\n")
    settings = config()
    settings["docs_dir"] = str(docs)
    settings["hooks"] = [str(DOCS / "hooks.py")]
    text = yaml.safe_dump(settings).replace("- client\n", f"- {ROOT / 'client'}\n")
    copy = tmp_path / "mkdocs.yml"
    copy.write_text(text, encoding="utf-8")
    return copy


def test_a_broken_link_fails_the_strict_build(tmp_path: Path) -> None:
    broken = "See [a page](trainers/no-such-page.md) and [a heading](trainers/statuses.md#no-such-heading)."
    result = mkdocs_build(broken_copy(tmp_path, "benchmarks.md", broken), tmp_path / "site")
    assert result.returncode != 0, result.stdout + result.stderr
    assert "no-such-page.md" in result.stderr and "no-such-heading" in result.stderr, result.stderr


def load_hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("markdown", "said"),
    [
        pytest.param("See [it](repo:bench/no_such_bench.py).", "bench/no_such_bench.py", id="a-repo-link"),
        pytest.param("`tests/test_no_such.py` checks it.", "tests/test_no_such.py", id="a-named-file"),
        pytest.param("<!-- include: examples/no_such/README.md -->", "examples/no_such", id="an-include"),
    ],
)  # fmt: skip
def test_a_repository_path_that_does_not_exist_fails_the_build(markdown: str, said: str) -> None:
    """The hooks' own checks (a build runs them on every page; the build above shows a failing page
    aborts it), on a page of one line."""
    hooks = load_hooks()
    page = SimpleNamespace(file=SimpleNamespace(src_uri="benchmarks.md", content_string=""))
    site_config = SimpleNamespace(extra={})
    with pytest.raises(PluginError, match=re.escape(said)):
        hooks.on_page_markdown(markdown, page, site_config, None)
    fine = "[the bench](repo:bench/common.py), `tests/test_docs.py`"
    fine = hooks.on_page_markdown(fine, page, site_config, None)
    assert fine == "the bench (`bench/common.py`), `tests/test_docs.py`"


def code_spans(html: str) -> set[str]:
    return {re.sub(r"<[^>]+>", "", span) for span in re.findall(r"<code>(.*?)</code>", html, flags=re.DOTALL)}


def test_the_settings_page_lists_every_setting(site: Path) -> None:
    listed = code_spans(page_html(site, "operators/settings.md"))
    missing = environment_names() - listed
    assert not missing, f"the settings page lacks {sorted(missing)}"
    assert "DATABASE_URL" in listed and "USER_SIM_BASE_URL" in listed


def test_the_metrics_page_lists_every_series(site: Path) -> None:
    from prometheus_client import CollectorRegistry

    from service.envs.remote.pool import PoolMetrics
    from service.metrics import Metrics

    listed = code_spans(page_html(site, "operators/metrics.md"))
    names = set()
    pools = CollectorRegistry()
    PoolMetrics(pools)
    for registry in (Metrics().registry, pools):
        for family in registry.collect():
            names.add(family.name + ("_total" if family.type == "counter" else ""))
    assert names and not names - listed, f"the metrics page lacks {sorted(names - listed)}"


class Headings(HTMLParser):
    """The text of every h3 of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self.texts: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "h3":
            self.depth = 1
            self.texts.append("")
        elif self.depth and tag == "a":  # the permalink
            self.depth = 2

    def handle_endtag(self, tag: str) -> None:
        if tag == "h3":
            self.depth = 0
        elif tag == "a" and self.depth == 2:
            self.depth = 1

    def handle_data(self, data: str) -> None:
        if self.depth == 1:
            self.texts[-1] += data


def test_the_api_page_covers_every_operation(site: Path) -> None:
    document = yaml.safe_load((ROOT / "openapi.yaml").read_text(encoding="utf-8"))
    operations = {
        f"{method.upper()} {path}" for path, item in document["paths"].items() for method in item
        if method in HTTP_METHODS
    }  # fmt: skip
    parser = Headings()
    parser.feed(page_html(site, "reference/http-api.md"))
    shown = {" ".join(text.split()) for text in parser.texts}
    assert operations and not operations - shown, f"the API page lacks {sorted(operations - shown)}"


def test_the_client_reference_covers_the_public_api(site: Path) -> None:
    html = page_html(site, "reference/client.md")
    names = [f"rollout_client.{name}" for name in rollout_client.__all__]
    for cls in (rollout_client.RolloutClient, rollout_client.AsyncRolloutClient):
        names += [f"rollout_client.{cls.__name__}.{name}" for name in vars(cls) if not name.startswith("_")]
    names += ["rollout_client.slime.generate", "rollout_client.slime.generate_rollout"]
    missing = [name for name in names if f'id="{name}"' not in html]
    assert not missing, f"the client reference lacks {missing}"


def test_the_arrow_page_lists_every_column(site: Path) -> None:
    listed = code_spans(page_html(site, "trainers/arrow-schema.md"))
    missing = set(ARROW_SCHEMA.names) - listed
    assert not missing, f"the Arrow page lacks {sorted(missing)}"


def test_every_bench_has_a_section(site: Path) -> None:
    html = page_html(site, "benchmarks.md")
    sections = set(re.findall(r"<h2 id=\"[^\"]*\"><code>([\w.]+)</code>", html))
    benches = {path.name for path in (ROOT / "bench").glob("*.py")} - {"common.py", "profiles.py"}
    assert not benches - sections, f"the benchmarks page lacks {sorted(benches - sections)}"
    assert "Options:" in html  # each section's options come from the bench's argparse


class Loads(HTMLParser):
    """Every URL a page loads (scripts, stylesheets, images, frames, media), not the links it shows."""

    LOADING = {"script": "src", "img": "src", "iframe": "src", "source": "src", "video": "src",
               "audio": "src", "embed": "src", "object": "data", "link": "href"}  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        attribute = self.LOADING.get(tag)
        if attribute and found.get(attribute):
            if tag == "link" and found.get("rel") in {"canonical", "prev", "next", "alternate"}:
                return
            self.urls.append(str(found[attribute]))
        if found.get("srcset"):
            self.urls += [part.split()[0] for part in str(found["srcset"]).split(",")]


def external(url: str) -> bool:
    return bool(re.match(r"^([a-z][a-z0-9+.-]*:)?//", url.strip(), flags=re.IGNORECASE))


def test_no_page_loads_anything_from_another_host(site: Path) -> None:
    pages = list(site.rglob("*.html"))
    assert len(pages) > 30
    for page in pages:
        parser = Loads()
        parser.feed(page.read_text(encoding="utf-8"))
        outside = [url for url in parser.urls if external(url)]
        assert not outside, f"{page.relative_to(site)} loads {outside}"
    for stylesheet in site.rglob("*.css"):
        text = stylesheet.read_text(encoding="utf-8")
        imports = re.findall(r"@import\s+(?:url\()?['\"]?([^'\")\s]+)", text)
        urls = re.findall(r"url\(\s*['\"]?([^'\")]+)", text)
        outside = [url for url in imports + urls if external(url)]
        assert not outside, f"{stylesheet.relative_to(site)} loads {outside}"


def test_the_readme_is_a_short_front_page_whose_links_resolve() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) < 150
    targets = re.findall(r"\]\(([^)\s]+)\)", readme)
    local = [target for target in targets if not re.match(r"^[a-z]+:", target)]
    assert len(local) > 20
    for target in local:
        path = target.split("#", 1)[0]
        assert (ROOT / path).exists(), f"the README links to {target}, which is not in the repository"
    pages = {path.relative_to(ROOT).as_posix() for path in DOCS.rglob("*.md")}
    linked = {target.split("#", 1)[0] for target in local}
    readers = {"docs/getting-started/index.md", "docs/trainers/index.md", "docs/environments.md",
               "docs/agents/index.md", "docs/operators/kubernetes.md", "docs/benchmarks.md"}  # fmt: skip
    assert readers <= linked & pages


def test_the_readme_quickstart_names_real_make_targets() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    commands = re.findall(r"^make (\w[\w-]*)", readme, flags=re.MULTILINE)
    assert commands[:2] == ["demo", "test"]
    for target in [*commands, *re.findall(r"`make (\w[\w-]*)`", readme)]:
        assert re.search(rf"^{target}:", makefile, flags=re.MULTILINE), f"no make target {target}"
