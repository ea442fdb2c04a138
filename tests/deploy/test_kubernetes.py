"""deploy/k8s: both overlays build (tests/deploy/kustomize.py), every object they make is
valid against the Kubernetes API's schemas (kubernetes-validate, offline, strict: no
field the API does not know), and the manifests say what seawall needs: resources,
probes, graceful shutdown, non-root pods, the key pepper from a Secret, and on GPUs a
worker per NVIDIA GPU scaled on the KV-cache metric that prometheus-adapter serves."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]  # ships no types
import pytest
import yaml

from seawall.kafka_acl import ADMISSION, CONTROLLER, INGRESS, WORKERS
from seawall.kafka_secrets import write_kafka_secrets
from tests.deploy.conftest import LoadSettings
from tests.deploy.kustomize import KustomizeError, build, merge

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("sim", "gpu")
# The oldest Kubernetes release still supported by the big clouds, and a recent one.
KUBERNETES_VERSIONS = ("1.29.0", "1.33.0")
ADAPTER_RULES = K8S / "overlays" / "gpu" / "prometheus-adapter-rules.yaml"
KV_METRIC = "seawall_engine_kv_cache_usage_ratio"
PEPPER_SECRET = "seawall-key-pepper"
SAMPLING_SECRET = "seawall-sampling-secret"
SAMPLING_FILE = "sampling_secret"

Obj = dict[str, Any]


def render(overlay: str) -> list[Obj]:
    return build(K8S / "overlays" / overlay)


def one(objects: list[Obj], kind: str, name: str) -> Obj:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def deployments(objects: list[Obj]) -> list[Obj]:
    return [o for o in objects if o["kind"] == "Deployment"]


def seawall_deployments(objects: list[Obj]) -> list[Obj]:
    return [d for d in deployments(objects) if module_of(d) is not None]


def container(deployment: Obj) -> Obj:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    assert isinstance(c, dict)
    return c


def module_of(deployment: Obj) -> str | None:
    command = container(deployment).get("command", [])
    return command[2] if command[:2] == ["python", "-m"] else None


def env_of(deployment: Obj, objects: list[Obj]) -> dict[str, str]:
    """The container's environment as Kubernetes makes it: its ConfigMaps, then ``env``."""
    c = container(deployment)
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        env |= one(objects, "ConfigMap", source["configMapRef"]["name"])["data"]
    for var in c.get("env", []):
        env[var["name"]] = var.get("value", "<from a reference>")
    return env


def secret_file_volume(d: Obj, path: Path) -> Obj:
    """The volume ``d`` mounts read-only at ``path``'s folder, holding that one file of
    a Secret (the caller checks which)."""
    (mount,) = [m for m in container(d)["volumeMounts"] if Path(m["mountPath"]) == path.parent]
    assert mount["readOnly"] is True, d["metadata"]["name"]
    volumes = d["spec"]["template"]["spec"]["volumes"]
    (volume,) = [v for v in volumes if v["name"] == mount["name"]]
    assert volume["secret"]["items"] == [{"key": path.name, "path": path.name}]
    return volume


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_is_valid_for_the_kubernetes_api(overlay: str, version: str) -> None:
    for obj in render(overlay):
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            where = "/".join(str(p) for p in e.path)
            pytest.fail(f"{overlay}: {obj['kind']} {obj['metadata']['name']}: {where}: {e.message}")


def test_the_validator_refuses_what_the_api_would() -> None:
    """kubernetes-validate is strict here: an unknown field and a wrong type both fail."""
    deployment = one(render("sim"), "Deployment", "ingress")
    typo = merge(deployment, {"spec": {"template": {"spec": {"terminationGracePeriod": 30}}}})
    wrong = merge(deployment, {"spec": {"replicas": "two"}})
    for broken in (typo, wrong):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)


def test_the_renderer_merges_as_kustomize_does() -> None:
    base = {
        "spec": {
            "replicas": 2,
            "containers": [
                {"name": "a", "env": [{"name": "X", "value": "1"}, {"name": "Y", "value": "2"}]},
                {"name": "b", "args": ["--one"]},
            ],
        }
    }
    patch = {
        "spec": {
            "replicas": None,
            "containers": [
                {"name": "a", "env": [{"name": "Y", "value": "3"}, {"name": "Z", "value": "4"}]},
                {"name": "b", "args": ["--two"]},
            ],
        }
    }
    assert merge(base, patch) == {
        "spec": {
            "containers": [
                {
                    "name": "a",
                    "env": [
                        {"name": "Y", "value": "3"},
                        {"name": "Z", "value": "4"},
                        {"name": "X", "value": "1"},
                    ],
                },
                {"name": "b", "args": ["--two"]},
            ]
        }
    }
    with pytest.raises(KustomizeError):
        merge(base, {"spec": {"$patch": "replace"}})


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_everything_lives_in_the_seawall_namespace(overlay: str) -> None:
    objects = render(overlay)
    assert one(objects, "Namespace", "seawall")
    for obj in objects:
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "seawall", obj["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_services_are_all_there(overlay: str) -> None:
    objects = render(overlay)
    by_module: dict[str, list[str]] = {}
    for d in seawall_deployments(objects):
        by_module.setdefault(str(module_of(d)), []).append(d["metadata"]["name"])
    assert by_module == {
        "services.ingress": ["ingress"],
        "services.admission": ["admission"],
        "services.controller": ["controller"],
        "services.workers": ["worker-main", "worker-small"],
    }
    # Each worker serves one of the fleet's pools (settings do not check this).
    pools = {
        d["metadata"]["name"]: env_of(d, objects)["SEAWALL_POOL"]
        for d in seawall_deployments(objects)
        if module_of(d) == "services.workers"
    }
    assert pools == {"worker-main": "main", "worker-small": "small"}
    for d in seawall_deployments(objects):
        assert set(pools.values()) == set(env_of(d, objects)["SEAWALL_POOLS"].split(","))
    small = env_of(one(objects, "Deployment", "worker-small"), objects)
    assert small["SEAWALL_SIM_MODEL"] == "llama-3.2-1b"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_is_bounded_non_root_and_stops_gracefully(overlay: str) -> None:
    objects = render(overlay)
    for d in deployments(objects):
        name = d["metadata"]["name"]
        pod = d["spec"]["template"]["spec"]
        assert matches(
            d["spec"]["selector"]["matchLabels"], d["spec"]["template"]["metadata"]["labels"]
        )
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        # Service links would add e.g. INGRESS_PORT=tcp://… to the environment, where
        # seawall (and the Kafka image) read their settings.
        assert pod["enableServiceLinks"] is False, name
        for c in pod["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, name
            for bound in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][bound]), (name, bound)
            assert c.get("readinessProbe"), name
            assert c.get("livenessProbe"), name
        if module_of(d) is not None:
            # SEAWALL_SHUTDOWN_GRACE_S (20 s) to finish in-flight work, then some.
            grace = float(env_of(d, objects)["SEAWALL_SHUTDOWN_GRACE_S"])
            assert pod["terminationGracePeriodSeconds"] == 30 > grace, name
            assert pod["securityContext"]["runAsUser"] == 10001, name  # the image's user
            annotations = d["spec"]["template"]["metadata"]["annotations"]
            port = annotations["prometheus.io/port"]
            assert annotations["prometheus.io/scrape"] == "true", name
            assert annotations["prometheus.io/path"] == "/metrics", name
            served = {str(p["containerPort"]) for p in container(d)["ports"]}
            assert port in served, name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_service_gets_settings_it_accepts(overlay: str, load_settings: LoadSettings) -> None:
    """Each container's environment loads into its service's settings and names only
    settings that exist."""
    objects = render(overlay)
    for d in seawall_deployments(objects):
        env = env_of(d, objects)
        loaded = load_settings(str(module_of(d)), env)
        assert loaded.kafka_bootstrap == env["SEAWALL_KAFKA_BOOTSTRAP"]
        assert loaded.redis_url == env["SEAWALL_REDIS_URL"]
        if module_of(d) == "services.workers":
            assert loaded.pool in loaded.pools, d["metadata"]["name"]


def test_ingress_is_probed_on_health_and_served_by_a_service() -> None:
    objects = render("sim")
    d = one(objects, "Deployment", "ingress")
    c = container(d)
    port = next(p for p in c["ports"] if p["name"] == "http")
    metrics = next(p for p in c["ports"] if p["name"] == "metrics")
    assert metrics["containerPort"] != port["containerPort"]  # not on the public API
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] == "/health"
        assert c[probe]["httpGet"]["port"] == port["name"]
    assert env_of(d, objects)["SEAWALL_INGRESS_PORT"] == str(port["containerPort"]) == "8080"
    assert env_of(d, objects)["SEAWALL_INGRESS_HOST"] == "0.0.0.0"
    service = one(objects, "Service", "ingress")
    assert matches(service["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])
    assert service["spec"]["ports"][0]["targetPort"] == port["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ingress_and_admission_have_disruption_budgets(overlay: str) -> None:
    objects = render(overlay)
    for name in ("ingress", "admission"):
        labels = one(objects, "Deployment", name)["spec"]["template"]["metadata"]["labels"]
        pdb = one(objects, "PodDisruptionBudget", name)
        assert matches(pdb["spec"]["selector"]["matchLabels"], labels)
        # maxUnavailable, not minAvailable: a drain never blocks, even at one replica.
        assert pdb["spec"]["maxUnavailable"] == 1


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_key_pepper_comes_from_a_secret_that_is_not_in_the_repository(overlay: str) -> None:
    objects = render(overlay)
    assert not [o for o in objects if o["kind"] == "Secret"]
    for d in seawall_deployments(objects):
        assert "SEAWALL_KEY_PEPPER" not in env_of(d, objects), d["metadata"]["name"]
    d = one(objects, "Deployment", "ingress")
    path = Path(env_of(d, objects)["SEAWALL_KEY_PEPPER_FILE"])
    (mount,) = [m for m in container(d)["volumeMounts"] if Path(m["mountPath"]) == path.parent]
    (volume,) = [v for v in d["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == PEPPER_SECRET
    assert mount["readOnly"] is True
    # The file is the Secret's key of the same name (`--from-file=key_pepper=…`).
    assert path.name == "key_pepper"
    assert f"--from-file={path.name}=" in (K8S / "base" / "kustomization.yaml").read_text()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_service_mounts_only_the_keys_of_its_roles_and_hops(overlay: str) -> None:
    """Followers mount trusted.pub and their role's private key only; each side of a
    signed hop its secret (services.common.hop_signing)."""
    objects = render(overlay)
    expected = {
        "ingress": {"requests.hmac", "hints.hmac"},
        "admission": {
            "trusted.pub",
            "requests.hmac",
            "dispatch.hmac",
            "hints.hmac",
            "telemetry.hmac",
        },
        "controller": {"trusted.pub", "controller.key", "telemetry.hmac"},
    }
    for d in seawall_deployments(objects):
        name = d["metadata"]["name"]
        if name.startswith("worker-"):
            expected[name] = {"trusted.pub", "worker.key", "dispatch.hmac", "telemetry.hmac"}
    assert {"worker-main", "worker-small"} <= set(expected)
    for name, files in expected.items():
        d = one(objects, "Deployment", name)
        path = Path(env_of(d, objects)["SEAWALL_CONTROL_KEYS_DIR"])
        (mount,) = [m for m in container(d)["volumeMounts"] if Path(m["mountPath"]) == path]
        assert mount["readOnly"] is True
        (volume,) = [
            v for v in d["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]
        ]
        assert volume["secret"]["secretName"] == "seawall-control-keys"
        assert {item["path"] for item in volume["secret"]["items"]} == files, name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_admission_and_the_workers_read_one_sampling_secret_from_a_secret(overlay: str) -> None:
    """The canary split and the shadow sample are keyed with one fleet-wide secret
    (services.common.sampling), which admission and the workers refuse to start
    without: each reads it from the same Secret, read-only; ingress and the controller
    get none."""
    objects = render(overlay)
    sampling = {"admission", "worker-main", "worker-small"}
    for d in seawall_deployments(objects):
        name = d["metadata"]["name"]
        env = env_of(d, objects)
        volumes = d["spec"]["template"]["spec"]["volumes"]
        if name not in sampling:
            assert "SEAWALL_SAMPLING_SECRET_FILE" not in env, name
            assert SAMPLING_SECRET not in str(volumes), name
            continue
        volume = secret_file_volume(d, Path(env["SEAWALL_SAMPLING_SECRET_FILE"]))
        assert volume["secret"]["secretName"] == SAMPLING_SECRET, name
    assert {d["metadata"]["name"] for d in seawall_deployments(objects)} >= sampling
    assert (
        f"--from-file={SAMPLING_FILE}={SAMPLING_FILE}"
        in (K8S / "base" / "kustomization.yaml").read_text()
    )


REDIS_SECRET = "seawall-redis"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_services_that_use_redis_log_in_with_a_password_from_a_secret(overlay: str) -> None:
    """Ingress, admission and the workers log in to Redis as its `seawall` ACL user
    (``seawall redis-acl``), the password read from the Secret seawall-redis; the
    controller, which needs Redis only for the embedded broker's doorbell, gets none."""
    objects = render(overlay)
    users = {"ingress", "admission", "worker-main", "worker-small"}
    for d in seawall_deployments(objects):
        name = d["metadata"]["name"]
        env = env_of(d, objects)
        volumes = d["spec"]["template"]["spec"]["volumes"]
        if name not in users:
            assert "SEAWALL_REDIS_PASSWORD_FILE" not in env, name
            assert REDIS_SECRET not in str(volumes), name
            continue
        assert env["SEAWALL_REDIS_USERNAME"] == "seawall", name
        volume = secret_file_volume(d, Path(env["SEAWALL_REDIS_PASSWORD_FILE"]))
        assert volume["secret"]["secretName"] == REDIS_SECRET, name
    assert {d["metadata"]["name"] for d in seawall_deployments(objects)} >= users


def test_the_sim_overlays_redis_admits_only_the_acl_files_users() -> None:
    redis = one(render("sim"), "Deployment", "redis")
    pod = redis["spec"]["template"]["spec"]
    command = container(redis)["command"]
    volume = secret_file_volume(redis, Path(command[command.index("--aclfile") + 1]))
    assert volume["secret"]["secretName"] == REDIS_SECRET
    # Secret files belong to root: the redis user reads it through its group.
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"]
    assert volume["secret"]["defaultMode"] & 0o040
    readme = (ROOT / "deploy" / "README.md").read_text()
    assert f"create secret generic {REDIS_SECRET}" in readme


def test_the_sim_overlay_runs_simulated_workers_beside_its_own_kafka_and_redis() -> None:
    objects = render("sim")
    for d in seawall_deployments(objects):
        env = env_of(d, objects)
        assert env.get("SEAWALL_ENGINE", "sim") == "sim"
        assert "nvidia.com/gpu" not in str(container(d)["resources"])
        assert d["spec"]["replicas"] <= 2, d["metadata"]["name"]
    env = env_of(one(objects, "Deployment", "ingress"), objects)
    kafka_host, kafka_port = env["SEAWALL_KAFKA_BOOTSTRAP"].split(":")
    kafka = one(objects, "Service", kafka_host)
    assert kafka["spec"]["ports"][0]["port"] == int(kafka_port)
    assert container(one(objects, "Deployment", "kafka"))["ports"][0]["containerPort"] == int(
        kafka_port
    )
    redis_host = re.fullmatch(r"redis://([^:/]+):(\d+)/\d+", env["SEAWALL_REDIS_URL"])
    assert redis_host is not None
    redis = one(objects, "Service", redis_host.group(1))
    assert redis["spec"]["ports"][0]["port"] == int(redis_host.group(2))
    # One broker: every partition has one replica.
    assert env["SEAWALL_TOPIC_REPLICATION"] == "1"


KAFKA_SECRET = "seawall-kafka"
PRINCIPAL_OF_MODULE = {
    "services.ingress": INGRESS,
    "services.admission": ADMISSION,
    "services.controller": CONTROLLER,
    "services.workers": WORKERS,
}


def secret_items(d: Obj, mount_path: str) -> tuple[str, dict[str, str]]:
    """The Secret ``d``'s container mounts (read-only) at ``mount_path``, and its items
    (file name → key)."""
    (mount,) = [m for m in container(d)["volumeMounts"] if m["mountPath"] == mount_path]
    assert mount["readOnly"] is True
    volumes = d["spec"]["template"]["spec"]["volumes"]
    (volume,) = [v for v in volumes if v["name"] == mount["name"]]
    items = {i["path"]: i["key"] for i in volume["secret"]["items"]}
    return volume["secret"]["secretName"], items


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_service_logs_in_to_kafka_as_its_principal_with_its_password_only(
    overlay: str,
) -> None:
    objects = render(overlay)
    for d in seawall_deployments(objects):
        name = d["metadata"]["name"]
        env = env_of(d, objects)
        principal = PRINCIPAL_OF_MODULE[module_of(d) or ""]
        assert env["SEAWALL_KAFKA_SECURITY_PROTOCOL"] == "SASL_SSL", name
        assert env["SEAWALL_KAFKA_SASL_MECHANISM"] == "SCRAM-SHA-512", name
        assert env["SEAWALL_KAFKA_SASL_USERNAME"] == principal, name
        password, ca = (
            Path(env["SEAWALL_KAFKA_SASL_PASSWORD_FILE"]),
            env["SEAWALL_KAFKA_SSL_CAFILE"],
        )
        assert Path(ca).parent == password.parent, name
        secret, items = secret_items(d, str(password.parent))
        assert secret == KAFKA_SECRET, name
        # Its own password, under the name `seawall kafka-secrets` gives it, and the CA.
        assert items == {password.name: f"{principal}.password", Path(ca).name: "ca.pem"}, name
    readme = (ROOT / "deploy" / "README.md").read_text()
    assert f"create secret generic {KAFKA_SECRET}" in readme


def test_the_sim_overlays_kafka_admits_only_seawalls_principals_with_their_acls(
    tmp_path: Path,
) -> None:
    """The broker runs `seawall kafka-secrets`'s start script on its server.properties,
    every file they read mounted from the Secret under the name they read it by; the
    Job applies the ACLs as `admin`; the address the broker advertises to containers is
    the one the services are given."""
    write_kafka_secrets(tmp_path, hosts=("kafka", "localhost", "127.0.0.1"))
    objects = render("sim")
    broker = one(objects, "Deployment", "kafka")
    assert container(broker)["command"] == ["bash", "/run/secrets/kafka_start"]
    secret, items = secret_items(broker, "/run/secrets")
    assert secret == KAFKA_SECRET
    assert items["kafka_start"] == "start-kafka.sh"
    assert items["kafka_server_properties"] == "server.properties"
    server = (tmp_path / "server.properties").read_text()
    start = (tmp_path / "start-kafka.sh").read_text()
    for path in re.findall(r"/run/secrets/(\w+)", server + start):
        assert path in items, path
        assert (tmp_path / items[path]).exists(), path
    advertised = re.search(r"INTERNAL://([^,\n]+)", server.split("advertised.listeners=")[1])
    assert advertised is not None
    env = env_of(one(objects, "Deployment", "ingress"), objects)
    assert advertised.group(1) == env["SEAWALL_KAFKA_BOOTSTRAP"]
    pod = broker["spec"]["template"]["spec"]
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"]
    job = one(objects, "Job", "kafka-acls")
    assert container(job)["command"] == ["bash", "/run/secrets/kafka_acls"]
    secret, items = secret_items(job, "/run/secrets")
    assert secret == KAFKA_SECRET
    assert items == {
        "kafka_acls": "acls.sh",
        "kafka_admin_properties": "admin.properties",
        "kafka_ca": "ca.pem",
    }
    assert "/run/secrets/kafka_admin_properties" in (tmp_path / "acls.sh").read_text()
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "OnFailure"


def test_the_gpu_overlay_runs_the_main_pool_on_vllm_one_gpu_per_worker() -> None:
    objects = render("gpu")
    worker = one(objects, "Deployment", "worker-main")
    env = env_of(worker, objects)
    assert env["SEAWALL_POOL"] == "main"
    assert env["SEAWALL_ENGINE"] == "vllm"
    assert env["SEAWALL_VLLM_MODEL"]
    c = container(worker)
    assert c["image"].split(":")[0] == "seawall-vllm"  # built with the vllm extra
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    pod = worker["spec"]["template"]["spec"]
    assert pod["nodeSelector"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    # Model loading takes minutes: a startup probe holds the liveness probe off.
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 600
    # The HPA owns the replica count: a Deployment naming one would reset it on apply.
    assert "replicas" not in worker["spec"]
    # Nothing else asks for a GPU.
    for d in deployments(objects):
        if d is not worker:
            assert "nvidia.com/gpu" not in str(container(d)["resources"]), d["metadata"]["name"]


def test_the_hpa_scales_the_vllm_workers_on_the_metric_the_adapter_serves() -> None:
    objects = render("gpu")
    (hpa,) = [o for o in objects if o["kind"] == "HorizontalPodAutoscaler"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"]) == ("apps/v1", "Deployment")
    worker = one(objects, "Deployment", target["name"])
    assert env_of(worker, objects)["SEAWALL_ENGINE"] == "vllm"
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == KV_METRIC
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "800m"}

    # prometheus-adapter's rule serves that name, for pods, from that series.
    config_map = yaml.safe_load(ADAPTER_RULES.read_text())
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(config_map, version, strict=True)
    (rule,) = yaml.safe_load(config_map["data"]["config.yaml"])["rules"]
    assert rule["seriesQuery"] == f'{KV_METRIC}{{namespace!="",pod!=""}}'
    assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
    assert rule["resources"]["overrides"]["namespace"] == {"resource": "namespace"}
    assert re.fullmatch(rule["name"]["matches"], KV_METRIC)
    assert rule["name"]["as"] == metric["pods"]["metric"]["name"]
    assert "<<.Series>>" in rule["metricsQuery"]
    assert "<<.LabelMatchers>>" in rule["metricsQuery"]
    # Workers export the series (services/workers): the name is not a guess.
    sources = "\n".join(p.read_text() for p in (ROOT / "services").rglob("*.py"))
    assert f'"{KV_METRIC}"' in sources


@pytest.mark.parametrize("overlay", ["base", *(f"overlays/{o}" for o in OVERLAYS)])
def test_the_builder_renders_what_kustomize_renders(overlay: str) -> None:
    """The tests' small kustomize against the real one (``kubectl kustomize``), object
    for object and field for field (kubectl orders the objects by kind), where kubectl
    is installed."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: no kustomize to compare the builder with")
    done = subprocess.run(
        [kubectl, "kustomize", str(K8S / overlay)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr

    def by_kind_and_name(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return sorted(objects, key=lambda o: (o["kind"], o["metadata"]["name"]))

    rendered = list(yaml.safe_load_all(done.stdout))
    assert by_kind_and_name(build(K8S / overlay)) == by_kind_and_name(rendered)
