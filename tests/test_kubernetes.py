"""deploy/kubernetes: each overlay renders with `kubectl kustomize` (no cluster), every object is valid
against the Kubernetes schemas (kubernetes-validate, offline, strict: no unknown field), and the
deployment's invariants hold: the migration Job before the Deployments (whose init containers wait
for its schema), probes on /health and /ready, no secret in the manifests, a termination grace
longer than the drain, requests on every container, the scrape annotation, the one Service on the
API pods, disruption budgets, and the autoscaler on the service's own outstanding-episodes gauge."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from service.config import Settings
from service.envs.base import UserSimConfig
from service.metrics import Metrics

REPO_DIR = Path(__file__).resolve().parents[1]
KUBERNETES_DIR = REPO_DIR / "deploy" / "kubernetes"
OVERLAYS = sorted(path.name for path in (KUBERNETES_DIR / "overlays").iterdir())
# The oldest and the newest Kubernetes minor versions the manifests are checked against.
KUBERNETES_VERSIONS = ("1.28", "1.33")
SERVICE_PORT = 8000
GRACE_MARGIN_SECONDS = 10  # past the preStop pause and the drain: uvicorn's exit, the interpreter's
# Environment variables a container may hold that are not Settings (service/config.py).
OTHER_VARIABLES = {"HF_HOME", "HF_TOKEN", "POSTGRES_USER", "POSTGRES_DB", "POSTGRES_PASSWORD", "PGDATA"}
SECRET_NAMES = re.compile(r"PASSWORD|API_KEY|^API_PROJECTS$|_TOKEN$|SECRET|^DATABASE_URL$")
# A URL with credentials in it: scheme://user:password@host.
URL_WITH_PASSWORD = re.compile(r"[a-z+]+://[^/\s:@]+:[^/\s@]+@")

pytestmark = pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl (its built-in kustomize) is not installed here"
)

Object = dict[str, Any]


def render(overlay: str) -> tuple[str, list[Object]]:
    result = subprocess.run(
        ["kubectl", "kustomize", str(KUBERNETES_DIR / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout, [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[Object]]:
    return render(request.param)


def of_kind(objects: list[Object], kind: str) -> list[Object]:
    return [item for item in objects if item["kind"] == kind]


def named(objects: list[Object], kind: str, name: str) -> Object:
    (item,) = [item for item in of_kind(objects, kind) if item["metadata"]["name"] == name]
    return item


def service_deployments(objects: list[Object]) -> list[Object]:
    return [
        item for item in of_kind(objects, "Deployment") if item["metadata"]["name"].startswith("rollout-")
    ]


def config(objects: list[Object]) -> dict[str, str]:
    data: dict[str, str] = named(objects, "ConfigMap", "rollout-service")["data"]
    return data


def test_the_overlays_are_the_two_documented() -> None:
    assert OVERLAYS == ["external-database", "in-cluster-postgres"]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_is_valid_against_the_kubernetes_schemas(
    rendered: tuple[str, list[Object]], version: str
) -> None:
    _, objects = rendered
    assert objects
    for item in objects:
        kubernetes_validate.validate(item, version, strict=True)
    # The validator does refuse what Kubernetes would: an unknown field, a wrong type.
    broken = copy.deepcopy(named(objects, "Deployment", "rollout-worker"))
    broken["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["pth"] = "/health"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, version, strict=True)
    broken = copy.deepcopy(named(objects, "Deployment", "rollout-api"))
    broken["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, version, strict=True)


def test_the_migration_job_comes_first_and_the_service_waits_for_its_schema(
    rendered: tuple[str, list[Object]],
) -> None:
    _, objects = rendered
    kinds = [item["kind"] for item in objects]
    assert kinds.index("Job") < kinds.index("Deployment")
    job = named(objects, "Job", "rollout-migrate")
    (migrate,) = job["spec"]["template"]["spec"]["containers"]
    assert migrate["command"] == ["python", "-m", "service", "migrate"]
    deployments = service_deployments(objects)
    assert {item["metadata"]["name"] for item in deployments} == {"rollout-api", "rollout-worker"}
    for deployment in deployments:
        (wait,) = deployment["spec"]["template"]["spec"]["initContainers"]
        command = wait["command"]
        assert command[:6] == ["python", "-m", "service", "migrate", "--check", "--wait"], command
        assert float(command[6]) > 0


def test_probes_are_on_health_and_ready(rendered: tuple[str, list[Object]]) -> None:
    """Workers are ready on /ready (database, engine, no pause). The API pods behind the Service are
    ready on /health: /ready is 503 in every process while generation is paused, and a trainer must
    reach /engine/continue then."""
    _, objects = rendered
    for deployment in service_deployments(objects):
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        ports = {port["name"]: port["containerPort"] for port in container["ports"]}
        api = deployment["metadata"]["name"] == "rollout-api"
        for probe, path in (
            ("livenessProbe", "/health"),
            ("readinessProbe", "/health" if api else "/ready"),
            ("startupProbe", "/health"),
        ):
            get = container[probe]["httpGet"]
            assert get["path"] == path and ports[get["port"]] == SERVICE_PORT, (
                deployment["metadata"]["name"],
                probe,
            )
            assert "httpHeaders" not in get  # a probe sends no key: the paths are public (middleware.py)


def test_no_secret_is_written_in_a_manifest(rendered: tuple[str, list[Object]]) -> None:
    text, objects = rendered
    assert not of_kind(objects, "Secret")
    assert not URL_WITH_PASSWORD.search(text), URL_WITH_PASSWORD.search(text)
    assert not any(SECRET_NAMES.search(key) for key in config(objects))
    for item in objects:
        template = item.get("spec", {}).get("template", {}).get("spec", {})
        for container in template.get("containers", []) + template.get("initContainers", []):
            for variable in container.get("env", []):
                if SECRET_NAMES.search(variable["name"]):
                    assert "value" not in variable, (item["metadata"]["name"], variable)
                    assert "secretKeyRef" in variable["valueFrom"], (item["metadata"]["name"], variable)


def test_termination_grace_outlasts_the_drain(rendered: tuple[str, list[Object]]) -> None:
    _, objects = rendered
    drain = float(config(objects)["SHUTDOWN_TIMEOUT_SECONDS"])
    assert drain == Settings.model_fields["shutdown_timeout_seconds"].default
    for deployment in service_deployments(objects):
        spec = deployment["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        pause = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
        assert spec["terminationGracePeriodSeconds"] >= pause + drain + GRACE_MARGIN_SECONDS


def test_every_container_requests_cpu_and_memory(rendered: tuple[str, list[Object]]) -> None:
    _, objects = rendered
    pods = [item["spec"]["template"]["spec"] for item in objects if "template" in item.get("spec", {})]
    assert len(pods) >= 3
    for pod in pods:
        for container in pod["containers"] + pod.get("initContainers", []):
            assert {"cpu", "memory"} <= set(container["resources"]["requests"]), container["name"]


def test_settings_are_the_services_own(rendered: tuple[str, list[Object]]) -> None:
    """A misspelt key in the ConfigMap would be ignored by the service: every key is a setting."""
    _, objects = rendered
    settings = {name.upper() for name in Settings.model_fields} | {
        str(field.validation_alias).upper() for field in UserSimConfig.model_fields.values()
    }
    assert set(config(objects)) - settings <= OTHER_VARIABLES
    for deployment in service_deployments(objects):
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        assert container["envFrom"] == [{"configMapRef": {"name": "rollout-service"}}]
        names = {variable["name"] for variable in container["env"]}
        assert names - settings <= OTHER_VARIABLES
        run_worker = {v["name"]: v.get("value") for v in container["env"]}["RUN_WORKER"]
        assert run_worker == ("true" if deployment["metadata"]["name"] == "rollout-worker" else "false")


def test_one_service_in_front_of_the_api_pods_and_every_pod_scraped(
    rendered: tuple[str, list[Object]],
) -> None:
    _, objects = rendered
    service = named(objects, "Service", "rollout-service")
    selector = service["spec"]["selector"]
    api, worker = named(objects, "Deployment", "rollout-api"), named(objects, "Deployment", "rollout-worker")
    assert selector.items() <= api["spec"]["template"]["metadata"]["labels"].items()
    assert not selector.items() <= worker["spec"]["template"]["metadata"]["labels"].items()
    for deployment in (api, worker):
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/path"] == "/metrics"
        assert int(annotations["prometheus.io/port"]) == SERVICE_PORT


def test_disruption_budgets_cover_both_deployments(rendered: tuple[str, list[Object]]) -> None:
    _, objects = rendered
    budgets = of_kind(objects, "PodDisruptionBudget")
    for deployment in service_deployments(objects):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        covering = [b for b in budgets if b["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        assert len(covering) == 1, deployment["metadata"]["name"]
        assert "maxUnavailable" in covering[0]["spec"]


def test_the_workers_scale_on_outstanding_episodes(rendered: tuple[str, list[Object]]) -> None:
    _, objects = rendered
    autoscaler = named(objects, "HorizontalPodAutoscaler", "rollout-worker")
    assert autoscaler["spec"]["scaleTargetRef"]["name"] == "rollout-worker"
    (metric,) = autoscaler["spec"]["metrics"]
    name = metric["external"]["metric"]["name"]
    assert name == "rollout_episodes_outstanding"
    assert f"# TYPE {name} gauge" in Metrics().render({}, 0, 0, paused=False).decode()
    # One replica per MAX_RUNNING_EPISODES outstanding: what one worker pod claims.
    assert metric["external"]["target"]["averageValue"] == config(objects)["MAX_RUNNING_EPISODES"]
    assert "replicas" in named(objects, "Deployment", "rollout-worker")["spec"]


def test_the_in_cluster_database_takes_its_password_from_a_secret() -> None:
    _, objects = render("in-cluster-postgres")
    postgres = named(objects, "StatefulSet", "rollout-postgres")
    (container,) = postgres["spec"]["template"]["spec"]["containers"]
    password = {v["name"]: v for v in container["env"]}["POSTGRES_PASSWORD"]
    assert password["valueFrom"]["secretKeyRef"]["name"] == "rollout-postgres"
    kinds = [item["kind"] for item in objects]
    assert kinds.index("StatefulSet") < kinds.index("Job")
