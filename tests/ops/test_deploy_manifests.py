"""Deployment files, validated without Docker or a cluster: Kubernetes manifests against the
API schemas (kubernetes-validate, strict) and the vendored KEDA CRD schema, the compose file
against the vendored Compose Specification schema after interpolation, the Prometheus config
with promtool, the Dockerfiles with hadolint, and how the pieces refer to each other. The
migration commands run against a real PostgreSQL."""

from __future__ import annotations

import copy
import os
import re
import select
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

import migrations
from gateway.cli import build_parser
from gateway.server.settings import GatewaySettings
from policies import TierTable
from tests.tenants.conftest import scratch_database

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "ops" / "docker"
K8S = REPO / "ops" / "k8s"
DOCKERFILES = sorted(DOCKER.glob("Dockerfile.*"))
K8S_FILES = sorted(K8S.glob("*.yaml"))
# The oldest Kubernetes the manifests claim, and the newest kubernetes-validate knows.
K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version())
# Kinds checked by hand or against a vendored schema rather than by kubernetes-validate.
NON_CORE_KINDS = {"Kustomization", "ScaledObject"}
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def k8s_objects() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in K8S_FILES:
        for doc in documents(path):
            yield path, doc


def k8s_object(kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for _, d in k8s_objects() if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def strict(schema: Any) -> Any:
    """An OpenAPI schema from a CRD with unknown fields rejected, as the API server's pruning
    would silently drop them (a typo in a field name would otherwise pass)."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {key: strict(value) for key, value in schema.items()}
    if (
        schema.get("type") == "object"
        and "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        result["additionalProperties"] = False
    return result


def keda_validator() -> jsonschema.Draft202012Validator:
    crd = yaml.safe_load((K8S / "schemas" / "keda.sh_scaledobjects.yaml").read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    return jsonschema.Draft202012Validator(strict(version["schema"]["openAPIV3Schema"]))


_VARIABLE = re.compile(r"\$(?:\$|\{(?P<name>\w+)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\})")


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Compose's variable substitution: ${X}, ${X:-default}, ${X-default}, ${X:?error}, $$."""
    if isinstance(value, dict):
        return {key: interpolate(item, env) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, env) for item in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        name, op, arg = match["name"], match["op"], match["arg"]
        if name is None:
            return "$"
        present = name in env and (env[name] != "" or not (op or "").startswith(":"))
        if present:
            return env[name]
        if op is not None and op.endswith("?"):
            raise KeyError(f"{name}: {arg}")
        return arg if op is not None else ""

    return _VARIABLE.sub(substitute, value)


def compose(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    raw = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    result: dict[str, Any] = interpolate(raw, {"TIERGATE_ADMIN_TOKEN": "t" * 32, **(env or {})})
    return result


def compose_validator() -> jsonschema.Draft7Validator:
    schema = yaml.safe_load((DOCKER / "schemas" / "compose-spec.json").read_text())
    return jsonschema.Draft7Validator(schema)


def dockerfile_stages(path: Path) -> list[list[tuple[str, str]]]:
    """(INSTRUCTION, arguments) per build stage, continuation lines joined."""
    text = re.sub(r"\\\n", " ", path.read_text())
    stages: list[list[tuple[str, str]]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, arguments = line.partition(" ")
        if instruction.upper() == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((instruction.upper(), arguments.strip()))
    return stages


def image_tag(image: str) -> str:
    name = image.rsplit("/", 1)[-1]
    assert ":" in name, f"{image} has no tag"
    return name.split(":", 1)[1]


def tool(name: str) -> str:
    """An executable from the test environment's bin directory or PATH; a missing one fails."""
    search = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    found = shutil.which(name, path=search)
    assert found, f"{name} is not installed (see ops/README.md, 'What CI validates')"
    return found


# --- Kubernetes ------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("path", K8S_FILES, ids=lambda p: p.name)
def test_core_manifests_pass_strict_schema_validation(path: Path, version: str) -> None:
    for doc in documents(path):
        if doc["kind"] not in NON_CORE_KINDS:
            kubernetes_validate.validate(doc, version, strict=True)


def test_every_kind_has_a_validator() -> None:
    kinds = {doc["kind"] for _, doc in k8s_objects()}
    assert kinds >= {"Deployment", "Service", "ConfigMap", "Secret", "Job"}
    assert kinds >= {"PodDisruptionBudget", "PersistentVolumeClaim", "ScaledObject"}
    for kind in kinds - NON_CORE_KINDS:
        doc = next(d for _, d in k8s_objects() if d["kind"] == kind)
        kubernetes_validate.validate(doc, K8S_VERSIONS[-1], strict=True)  # a schema exists


def test_the_validators_reject_an_unknown_field() -> None:
    deployment = copy.deepcopy(k8s_object("Deployment", "tiergate"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[-1], strict=True)
    scaled = copy.deepcopy(k8s_object("ScaledObject", "tiergate"))
    scaled["spec"]["minReplicas"] = 2
    assert not keda_validator().is_valid(scaled)
    services = compose()
    services["services"]["gateway"]["replicas"] = 2
    assert not compose_validator().is_valid(services)


def test_the_scaled_object_matches_the_keda_crd_and_scales_on_waiting_requests() -> None:
    scaled = k8s_object("ScaledObject", "tiergate")
    keda_validator().validate(scaled)
    spec = scaled["spec"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "tiergate",
    }
    assert 2 <= spec["minReplicaCount"] < spec["maxReplicaCount"]
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus"
    # The prometheus scaler's metadata is a free string map in the CRD: check its keys here.
    metadata = trigger["metadata"]
    assert metadata["serverAddress"].startswith("http")
    assert re.fullmatch(r"sum\(tiergate_requests_waiting(\{.*\})?\)", metadata["query"])
    assert float(metadata["threshold"]) > 0
    deployment = k8s_object("Deployment", "tiergate")
    assert deployment["spec"]["replicas"] == spec["minReplicaCount"]


def test_kustomization_applies_every_manifest_but_the_secret_example() -> None:
    (kustomization,) = documents(K8S / "kustomization.yaml")
    expected = {p.name for p in K8S_FILES} - {"kustomization.yaml", "secret.example.yaml"}
    assert sorted(kustomization["resources"]) == sorted(expected)
    # Namespaced objects name their namespace, so `kubectl apply -f` of one file works too.
    for _, doc in k8s_objects():
        if doc["kind"] not in ("Namespace", "Kustomization"):
            assert doc["metadata"]["namespace"] == "tiergate", doc["metadata"]["name"]


def test_the_deployment_serves_drains_and_uses_a_gpu() -> None:
    pod = k8s_object("Deployment", "tiergate")["spec"]["template"]["spec"]
    (gateway,) = pod["containers"]
    assert gateway["args"] == ["serve", "--no-migrate"]
    assert {p["name"]: p["containerPort"] for p in gateway["ports"]} == {"http": 8000}
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/health/ready", "port": "http"}
    assert gateway["livenessProbe"]["httpGet"] == {"path": "/health/live", "port": "http"}
    for kind in ("requests", "limits"):
        assert gateway["resources"][kind]["nvidia.com/gpu"] == "1"
    # preStop, then the drain deadline, must end before the kubelet's SIGKILL.
    (_, seconds) = gateway["lifecycle"]["preStop"]["exec"]["command"]
    drain_s = float(k8s_object("ConfigMap", "tiergate-env")["data"]["TIERGATE_DRAIN_TIMEOUT_S"])
    assert pod["terminationGracePeriodSeconds"] >= float(seconds) + drain_s + 10
    # A Service named tiergate would otherwise inject TIERGATE_PORT=tcp://...
    assert pod["enableServiceLinks"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001  # the images' USER
    for container in [*pod["initContainers"], *pod["containers"]]:
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = {m["name"]: m["mountPath"] for m in gateway["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts["models"] == "/models"
    claim = volumes["models"]["persistentVolumeClaim"]["claimName"]
    assert k8s_object("PersistentVolumeClaim", claim)


def test_secrets_come_from_the_secret_and_settings_from_the_configmaps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pod = k8s_object("Deployment", "tiergate")["spec"]["template"]["spec"]
    (gateway,) = pod["containers"]
    secret_keys = set(k8s_object("Secret", "tiergate-secrets")["stringData"])
    from_secret = {
        e["name"]: e["valueFrom"]["secretKeyRef"]["key"]
        for e in gateway["env"]
        if e["valueFrom"]["secretKeyRef"]["name"] == "tiergate-secrets"
    }
    assert set(from_secret) == {
        "TIERGATE_DATABASE_URL",
        "TIERGATE_REDIS_URL",
        "TIERGATE_ADMIN_TOKEN",
    }
    assert set(from_secret.values()) <= secret_keys
    (env_source,) = gateway["envFrom"]
    env = k8s_object("ConfigMap", env_source["configMapRef"]["name"])["data"]
    assert not set(env) & set(from_secret)
    # Every variable is one `tiergate serve` reads, and the values parse.
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    serve_help = " ".join(capsys.readouterr().out.split())
    for name in env:
        assert f"env {name})" in serve_help, f"{name} is not a setting of tiergate serve"
    config_mount = next(m for m in gateway["volumeMounts"] if m["name"] == "config")
    config_map = next(v for v in pod["volumes"] if v["name"] == "config")["configMap"]["name"]
    ((file_name, file_text),) = k8s_object("ConfigMap", config_map)["data"].items()
    assert env["TIERGATE_CONFIG"] == f"{config_mount['mountPath']}/{file_name}"
    config_file = tmp_path / file_name
    config_file.write_text(file_text)
    settings = GatewaySettings.from_sources(environ={**env, "TIERGATE_CONFIG": str(config_file)})
    assert (settings.host, settings.port, settings.device) == ("0.0.0.0", 8000, "cuda")
    assert TierTable.from_file(config_file).names == ["premium", "standard", "batch"]


def test_service_pdb_and_pod_labels_agree() -> None:
    template = k8s_object("Deployment", "tiergate")["spec"]["template"]
    labels = template["metadata"]["labels"]
    service = k8s_object("Service", "tiergate")["spec"]
    assert service["selector"].items() <= labels.items()
    assert service["ports"][0]["targetPort"] == "http"
    pdb = k8s_object("PodDisruptionBudget", "tiergate")["spec"]
    assert pdb["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["maxUnavailable"] == 1


def job_and_init_commands() -> tuple[list[str], list[str]]:
    job = k8s_object("Job", "tiergate-migrate")["spec"]["template"]["spec"]
    (migrate,) = job["containers"]
    assert job["restartPolicy"] == "Never"
    (wait,) = k8s_object("Deployment", "tiergate")["spec"]["template"]["spec"]["initContainers"]
    return migrate["command"], wait["command"]


def test_the_init_container_waits_until_the_job_has_migrated_a_real_postgresql(
    tmp_path: Path,
) -> None:
    job_command, wait_command = job_and_init_commands()
    assert job_command[:2] == wait_command[:2] == ["python", "-c"]
    # The compose stack's one-shot migration runs the very same code.
    assert compose()["services"]["migrate"]["entrypoint"] == job_command
    with scratch_database("postgresql", tmp_path) as url:
        env = {**os.environ, "TIERGATE_DATABASE_URL": url}
        waiting = subprocess.Popen(
            [sys.executable, *wait_command[1:]], env=env, stdout=subprocess.PIPE, text=True
        )
        try:
            assert waiting.stdout is not None
            # A bounded wait for its first line: a hung script fails rather than hangs.
            assert select.select([waiting.stdout], [], [], 60)[0], "no output in 60 s"
            assert "waiting for the migration Job" in waiting.stdout.readline()
            assert waiting.poll() is None
            subprocess.run([sys.executable, *job_command[1:]], env=env, check=True, timeout=120)
            assert migrations.current_revision(url) == migrations.head_revision()
            assert waiting.wait(timeout=60) == 0
        finally:
            waiting.kill()
            waiting.communicate()


def test_images_are_tagged_with_the_project_version_and_never_latest() -> None:
    version = PYPROJECT["project"]["version"]
    images = {}
    for _, doc in k8s_objects():
        pod = doc.get("spec", {}).get("template", {}).get("spec", {})
        for container in [*pod.get("initContainers", []), *pod.get("containers", [])]:
            images[container["image"]] = image_tag(container["image"])
    assert images == {
        f"tiergate:{version}-cuda": f"{version}-cuda",
        f"tiergate:{version}-cpu": f"{version}-cpu",
    }
    for service in compose()["services"].values():
        assert image_tag(service["image"]) != "latest"
    assert compose()["services"]["gateway"]["image"] == f"tiergate:{version}-cpu"


# --- Compose, Prometheus, Grafana --------------------------------------------------------


def test_compose_file_matches_the_compose_specification() -> None:
    compose_validator().validate(compose())
    compose_validator().validate(compose({"TIERGATE_MODELS_DIR": "/srv/models"}))
    with pytest.raises(KeyError, match="TIERGATE_ADMIN_TOKEN"):
        interpolate(yaml.safe_load((DOCKER / "compose.yaml").read_text()), {})


def test_compose_wires_replicas_database_redis_and_monitoring() -> None:
    services = compose()["services"]
    assert set(services) == {
        "postgres",
        "redis",
        "migrate",
        "gateway",
        "lb",
        "prometheus",
        "grafana",
    }
    gateway = services["gateway"]
    assert (REPO / gateway["build"]["dockerfile"]).is_file()
    assert (DOCKER / gateway["build"]["context"]).resolve() == REPO
    assert gateway["command"] == ["serve", "--no-migrate"]
    assert int(gateway["deploy"]["replicas"]) >= 2
    assert gateway["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert "@postgres:5432/" in gateway["environment"]["TIERGATE_DATABASE_URL"]
    assert gateway["environment"]["TIERGATE_REDIS_URL"].startswith("redis://redis:6379")
    assert "/models" in [v.split(":")[1] for v in gateway["volumes"]]
    grace_s = int(gateway["stop_grace_period"].removesuffix("s"))
    assert grace_s > GatewaySettings().drain_timeout_s
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DOCKER / source).exists(), f"{name}: {source} does not exist"
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} listens beyond loopback"
    nginx = (DOCKER / "nginx.conf").read_text()
    assert "server gateway:8000;" in nginx and "proxy_buffering off;" in nginx


def test_prometheus_config_loads_the_repository_rules_in_the_container_too() -> None:
    check = subprocess.run(
        [tool("promtool"), "check", "config", str(DOCKER / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    config = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    rule_files = sorted(p for g in config["rule_files"] for p in DOCKER.glob(g))
    assert {p.resolve().parent for p in rule_files} == {(REPO / "ops" / "prometheus").resolve()}
    assert f"SUCCESS: {len(rule_files)} rule files found" in check.stdout
    # Mounted with the repository's layout, the relative path resolves to the same files.
    prometheus = compose()["services"]["prometheus"]
    mounts = dict(v.split(":")[:2] for v in prometheus["volumes"])
    config_path = next(a.split("=", 1)[1] for a in prometheus["command"] if "config.file" in a)
    assert mounts["./prometheus.yml"] == config_path
    (pattern,) = config["rule_files"]
    in_container = PurePosixPath(os.path.normpath(PurePosixPath(config_path).parent / pattern))
    assert str(in_container.parent) == mounts["../prometheus"]
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "tiergate"]
    assert job["dns_sd_configs"][0]["names"] == ["gateway"]


def test_grafana_provisions_the_stack_prometheus_and_the_dashboards() -> None:
    grafana = compose()["services"]["grafana"]
    mounts = dict(v.split(":")[:2] for v in grafana["volumes"])
    (datasource,) = yaml.safe_load((DOCKER / "grafana" / "datasources.yaml").read_text())[
        "datasources"
    ]
    assert datasource["url"] == "http://prometheus:9090"
    (provider,) = yaml.safe_load((DOCKER / "grafana" / "dashboards.yaml").read_text())["providers"]
    assert mounts["../grafana"] == provider["options"]["path"]
    assert list((REPO / "ops" / "grafana").glob("*.json"))


# --- Dockerfiles ---------------------------------------------------------------------------


def test_hadolint_passes() -> None:
    lint = subprocess.run(
        [tool("hadolint"), "--config", str(DOCKER / ".hadolint.yaml"), *map(str, DOCKERFILES)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_images_run_as_non_root_with_a_health_check_and_a_model_volume(path: Path) -> None:
    stages = dockerfile_stages(path)
    for stage in stages:
        image = stage[0][1].split()[0]
        assert "$" not in image and image_tag(image) != "latest", image
    final = dict(stages[-1])  # the last of each instruction
    assert final["USER"] == "10001:10001"
    assert "/health/ready" in final["HEALTHCHECK"]
    assert '"/models"' in final["VOLUME"]
    assert final["ENTRYPOINT"] == '["tiergate"]' and final["CMD"] == '["serve"]'
    assert final["STOPSIGNAL"] == "SIGTERM"
    assert "TIERGATE_HOST=0.0.0.0" in final["ENV"]


def torch_installs(path: Path) -> list[str]:
    return [
        arguments
        for stage in dockerfile_stages(path)
        for instruction, arguments in stage
        if instruction == "RUN" and "torch==" in arguments
    ]


def test_the_cpu_image_installs_torch_only_from_the_cpu_index() -> None:
    path = DOCKER / "Dockerfile.cpu"
    (install,) = torch_installs(path)
    assert "--index-url https://download.pytorch.org/whl/cpu " in install
    text = path.read_text()
    assert not re.search(r"whl/cu\d+|extra-index-url|nvidia/cuda|\[cuda\]", text)
    pin = (REPO / "constraints.txt").read_text().split("torch==")[1].split()[0]
    assert f"ARG TORCH_VERSION={pin}\n" in text
    assert "--constraint /src/constraints.txt /src" in text
    assert "torch.version.cuda is None" in text  # the build fails on a CUDA torch


def test_the_cuda_image_installs_a_cu12_torch_and_the_cuda_extra() -> None:
    path = DOCKER / "Dockerfile.cuda"
    (install,) = torch_installs(path)
    assert "https://download.pytorch.org/whl/${TORCH_CUDA}" in install
    text = path.read_text()
    assert re.search(r"^ARG TORCH_CUDA=cu12\d$", text, re.MULTILINE)
    assert re.search(r"^FROM nvidia/cuda:12\.[\d.]+-runtime-", text, re.MULTILINE)
    pin = (REPO / "constraints.txt").read_text().split("torch==")[1].split()[0]
    assert f"ARG TORCH_VERSION={pin}\n" in text
    assert '"/src[cuda]"' in text


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_images_get_every_package_and_its_data_files(path: Path) -> None:
    # The images install the project as a wheel (not editable): what pyproject does not
    # declare as a package or package data is missing at run time.
    copied = {
        arguments.split()[0]
        for stage in dockerfile_stages(path)
        for instruction, arguments in stage
        if instruction == "COPY" and arguments.endswith(f"/src/{arguments.split()[0]}")
    }
    setuptools = PYPROJECT["tool"]["setuptools"]
    packages = {pattern.rstrip("*") for pattern in setuptools["packages"]["find"]["include"]}
    assert copied == packages
    package_data = setuptools.get("package-data", {})
    missing = []
    for package in sorted(packages):
        patterns = [*package_data.get(package, []), *package_data.get("*", [])]
        for file in sorted((REPO / package).rglob("*")):
            relative = file.relative_to(REPO / package)
            if (
                not file.is_file()
                or file.suffix in (".py", ".pyc")
                or "__pycache__" in str(relative)
            ):
                continue
            if not any(
                relative.match(p) and len(relative.parts) == len(Path(p).parts) for p in patterns
            ):
                missing.append(f"{package}/{relative}")
    assert not missing, f"not in [tool.setuptools.package-data]: {missing}"
