"""The deployment files: Kubernetes manifests valid against the API schema with their probes on
real endpoints, Dockerfiles that run as non-root with a working HEALTHCHECK, and a GitHub
workflow that runs what CI runs. (No Docker engine here: the images themselves are not built.)"""

from __future__ import annotations

import http.server
import os
import re
import shlex
import ssl
import subprocess
import threading
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

import pytest
import yaml

from asrserve.cli import build_parser
from asrserve.config import EngineConfig, ServerConfig
from asrserve.entrypoints.api_server import build_app
from tests.server_utils import free_port

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = sorted((ROOT / "docker" / "k8s").glob("*.yaml"))
DOCKERFILES = [ROOT / "docker" / "Dockerfile", ROOT / "docker" / "Dockerfile.cuda"]
KUBERNETES_VERSION = "1.32.0"


def _documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _by_kind(kind: str) -> list[tuple[Path, dict]]:
    return [(path, doc) for path in MANIFESTS for doc in _documents(path) if doc["kind"] == kind]


def _serve_options() -> set[str]:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    return {f"ASRSERVE_{action.dest.upper()}" for action in serve._actions if action.dest != "help"}


@pytest.fixture(scope="module")
def app_routes() -> set[str]:
    app = build_app(ServerConfig(), EngineConfig())
    return {route.path for route in app.routes}


def test_manifests_are_valid_against_the_kubernetes_schema():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    assert {doc["kind"] for path in MANIFESTS for doc in _documents(path)} >= {
        "Deployment", "Service", "HorizontalPodAutoscaler"
    }
    for path in MANIFESTS:
        for doc in _documents(path):
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)  # raises on any unknown field


def test_deployments_probe_real_endpoints_on_the_served_port(app_routes):
    deployments = _by_kind("Deployment")
    assert {path.name for path, _ in deployments} == {"deployment.yaml", "deployment-cuda.yaml"}
    for path, deployment in deployments:
        pod = deployment["spec"]["template"]
        (container,) = pod["spec"]["containers"]
        env = {item["name"]: item.get("value") for item in container["env"]}
        assert set(env) - {"OMP_NUM_THREADS"} <= _serve_options(), (path, set(env) - _serve_options())
        ports = {port["name"]: port["containerPort"] for port in container["ports"]}
        assert ports["http"] == int(env["ASRSERVE_PORT"])
        probes = [container[name] for name in ("startupProbe", "readinessProbe", "livenessProbe")]
        for probe in probes:
            assert probe["httpGet"]["path"] == "/health" and probe["httpGet"]["path"] in app_routes
            assert probe["httpGet"]["port"] in ("http", ports["http"])
        annotations = pod["metadata"]["annotations"]
        assert annotations["prometheus.io/path"] in app_routes
        assert int(annotations["prometheus.io/port"]) == ports["http"]
        resources = container["resources"]
        assert resources["requests"]["cpu"] and resources["limits"]["memory"]
        if "OMP_NUM_THREADS" in env:  # torch's and the C kernels' threads: the CPUs the pod asked for
            assert env["OMP_NUM_THREADS"] == resources["requests"]["cpu"]
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        # a Service named asrserve would otherwise set ASRSERVE_PORT=tcp://... in the pod
        assert pod["spec"]["enableServiceLinks"] is False
        # The pod is given longer than the server's own drain, so in-flight requests can finish.
        grace = float(env["ASRSERVE_GRACEFUL_SHUTDOWN_TIMEOUT_S"])
        assert pod["spec"]["terminationGracePeriodSeconds"] > grace + 5
        gpus = resources["limits"].get("nvidia.com/gpu")
        assert (gpus == 1) == (path.name == "deployment-cuda.yaml")
        assert {"/models"} <= {mount["mountPath"] for mount in container["volumeMounts"]}


def test_service_and_autoscaler_point_at_the_deployment():
    names = {doc["metadata"]["name"] for _, doc in _by_kind("Deployment")}
    labels = [doc["spec"]["template"]["metadata"]["labels"] for _, doc in _by_kind("Deployment")]
    ((_, service),) = _by_kind("Service")
    assert all(service["spec"]["selector"].items() <= label.items() for label in labels)
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    hpas = dict((path.name, hpa) for path, hpa in _by_kind("HorizontalPodAutoscaler"))
    assert set(hpas) == {"hpa.yaml", "hpa-queue.yaml"}
    exported = _exported_metrics()
    for name, hpa in hpas.items():
        assert hpa["spec"]["scaleTargetRef"]["name"] in names
        pods = [metric["pods"]["metric"]["name"] for metric in hpa["spec"]["metrics"] if metric["type"] == "Pods"]
        assert all(metric in exported for metric in pods)
        # A metric the cluster may lack blocks every scale-down: the HPA for any cluster has none.
        assert bool(pods) == (name == "hpa-queue.yaml"), name


def _exported_metrics() -> set[str]:
    from asrserve.entrypoints.metrics import ServerMetrics

    return {metric.name for metric in ServerMetrics().registry.collect()}


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", path.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda path: path.name)
def test_dockerfiles_run_the_server_as_non_root_with_a_model_volume(dockerfile):
    instructions = _instructions(dockerfile)
    kinds = [kind for kind, _ in instructions]
    users = [args for kind, args in instructions if kind == "USER"]
    assert users and users[-1] not in ("root", "0")
    assert kinds.index("USER") < kinds.index("ENTRYPOINT")
    env = " ".join(args for kind, args in instructions if kind == "ENV")
    assert set(re.findall(r"(ASRSERVE_\w+)=", env)) <= _serve_options()
    volumes = " ".join(args for kind, args in instructions if kind == "VOLUME")
    hf_home = re.search(r"HF_HOME=(\S+)", env).group(1)
    assert any(hf_home.startswith(volume) for volume in re.findall(r'"(/[^"]+)"', volumes))
    port = re.search(r"ASRSERVE_PORT=(\d+)", env).group(1)
    assert ("EXPOSE", port) in instructions
    entrypoint = next(args for kind, args in instructions if kind == "ENTRYPOINT")
    assert '"asrserve", "serve"' in entrypoint
    for kind, args in instructions:
        if kind == "COPY":
            for source in shlex.split(args)[:-1]:
                assert (ROOT / source).exists(), source
    assert any(kind == "RUN" and "torch==${TORCH_VERSION}" in args for kind, args in instructions)
    assert "/health" in next(args for kind, args in instructions if kind == "HEALTHCHECK")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda path: path.name)
def test_dockerfiles_copy_every_file_the_package_build_reads(dockerfile):
    """pip builds the package from what was copied: the readme and license files pyproject.toml
    names (without LICENSE setuptools warned, and the wheel had no license file)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needed = {"pyproject.toml", project["readme"], *project["license-files"], "asrserve"}
    copied = {source for kind, args in _instructions(dockerfile) if kind == "COPY" for source in shlex.split(args)[:-1]}
    assert needed <= copied, needed - copied


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda path: path.name)
def test_the_healthcheck_command_follows_health(dockerfile, tls, tmp_path):
    """Over https where the image serves TLS (ASRSERVE_SSL_CERTFILE): the check asked over plain
    HTTP, so a TLS container stayed unhealthy for good."""
    healthcheck = next(args for kind, args in _instructions(dockerfile) if kind == "HEALTHCHECK")
    command = healthcheck.split(" CMD ", 1)[1]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    env_tls = {}
    if tls:
        from tests.test_security import _self_signed_certificate

        cert, key = _self_signed_certificate(tmp_path)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(cert, key)
        server.socket = context.wrap_socket(server.socket, server_side=True)
        env_tls = {"ASRSERVE_SSL_CERTFILE": cert, "ASRSERVE_SSL_KEYFILE": key}
    threading.Thread(target=server.serve_forever, daemon=True).start()

    def exit_status(port: int) -> int:
        env = {**os.environ, "ASRSERVE_PORT": str(port), **env_tls}
        return subprocess.run(["sh", "-c", command], env=env, capture_output=True, timeout=30).returncode

    try:
        _Health.status = 200
        assert exit_status(server.server_port) == 0
        _Health.status = 503  # loading, draining, or the engine died
        assert exit_status(server.server_port) != 0
    finally:
        server.shutdown()
    assert exit_status(free_port()) != 0  # nothing listening


def test_the_github_workflow_runs_what_ci_runs():
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "ci.yml").read_text())
    (job,) = workflow["jobs"].values()
    commands = [step["run"] for step in job["steps"] if "run" in step]
    assert commands == ["bash .ci/run"]
    assert job["container"].startswith("python:3.11")  # CI's fresh Python 3.11, as root like CI
    ci_run = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    test_command = next(line for line in ci_run.splitlines() if "pytest" in line)
    assert test_command.strip() in readme  # .ci/run runs README's second quickstart command
