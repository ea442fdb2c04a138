"""compose/docker-compose.yml (and the Dockerfile it builds): valid against the Compose
Specification's JSON schema (vendored, compose-spec.NOTICE.md), and saying what seawall
needs: Kafka reachable from the containers, settings each service accepts, the fleet of
simulated workers, a vLLM worker on an NVIDIA GPU under the `gpu` profile, the key pepper
as a secret from a file git ignores, and Prometheus, Alertmanager and Grafana wired to
the services. Offline: nothing here starts Docker."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
from pathlib import Path, PurePosixPath
from typing import Any

import jsonschema  # type: ignore[import-untyped]  # no stubs in the dev set
import pytest
import yaml

from seawall.kafka_acl import ADMISSION, CONTROLLER, INGRESS, WORKERS
from seawall.kafka_secrets import write_kafka_secrets
from tests.deploy.conftest import LoadSettings

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
COMPOSE = ROOT / "compose" / "docker-compose.yml"
SCHEMA = HERE / "compose-spec.json"
SCHEMA_SHA256 = "56bab44c85c0ce8affb74474950293f37d510673283a243bcd7eeadb900fa35c"
INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(:?[-?])?([^}]*)\}")
# An interpolation, or `$$` (a literal `$`).
TOKEN = re.compile(r"\$\$|" + INTERPOLATION.pattern)

Obj = dict[str, Any]


def load() -> Obj:
    data: Obj = yaml.safe_load(COMPOSE.read_text())
    return data


def interpolate(value: str) -> str:
    """As `docker compose` does with none of the variables set: their defaults."""
    return TOKEN.sub(lambda m: "$" if m.group(0) == "$$" else m.group(3), value)


def environment(service: Obj) -> dict[str, str]:
    env = service.get("environment", {})
    assert isinstance(env, dict), "environment as a mapping"
    return {k: "" if v is None else str(v) for k, v in env.items()}


def seawall_services(compose: Obj) -> dict[str, Obj]:
    return {
        name: s
        for name, s in compose["services"].items()
        if s.get("command", [])[:2] == ["python", "-m"]
    }


def module_of(service: Obj) -> str:
    return str(service["command"][2])


def mounts(service: Obj) -> dict[str, str]:
    """Target → source (relative to the repository root) of the bind mounts."""
    out = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            out[target] = (COMPOSE.parent / source).resolve().relative_to(ROOT).as_posix()
    return out


def listeners(value: str) -> dict[str, tuple[str, int]]:
    """``NAME://host:port,…`` → name → (host, port)."""
    out = {}
    for item in value.split(","):
        name, address = item.split("://")
        host, port = address.rsplit(":", 1)
        out[name] = (host, int(port))
    return out


def seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration))


def test_the_vendored_schema_is_the_official_one_unchanged() -> None:
    assert hashlib.sha256(SCHEMA.read_bytes()).hexdigest() == SCHEMA_SHA256


def schema_errors(document: Obj) -> list[str]:
    schema = json.loads(SCHEMA.read_text())
    # Its "$schema" misspells draft 2019-09's address (http://json-schema.org/draft/
    # 2019-09/schema#): name the draft rather than let jsonschema guess.
    assert "2019-09" in schema["$schema"]
    jsonschema.Draft201909Validator.check_schema(schema)
    validator = jsonschema.Draft201909Validator(schema)
    return [
        f"{'/'.join(str(p) for p in e.absolute_path)}: {e.message}"
        for e in validator.iter_errors(document)
    ]


def test_the_compose_file_is_valid_against_the_compose_specification() -> None:
    assert schema_errors(load()) == []


def test_the_schema_refuses_what_compose_would() -> None:
    typo = load()
    typo["services"]["ingress"]["enviroment"] = {}
    wrong = load()
    wrong["services"]["worker-main"]["deploy"]["replicas"] = "two"
    gpu = load()
    gpu["services"]["worker-vllm"]["deploy"]["resources"]["reservations"]["gpus"] = 1
    for broken in (typo, wrong, gpu):
        assert schema_errors(broken)


def test_every_interpolation_has_a_default() -> None:
    """`docker compose up` works with no variable set (and `--profile gpu` too)."""
    text = COMPOSE.read_text()
    found = INTERPOLATION.findall(text)
    assert found
    for name, operator, _ in found:
        assert operator == ":-", name
    assert not re.search(r"\$(?!\{|\$)", text.replace("$$", "")), "a bare $VARIABLE"


@pytest.fixture(scope="module")
def kafka_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What `seawall kafka-secrets compose/secrets/kafka` writes (compose mounts it)."""
    directory = tmp_path_factory.mktemp("kafka-secrets")
    write_kafka_secrets(directory)
    return directory


def properties(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key] = value
    return out


def mounted_secrets(service: Obj) -> dict[str, str]:
    """Target → source of a service's secrets (a bare name: /run/secrets/<name>)."""
    out = {}
    for s in service.get("secrets", []):
        if isinstance(s, str):
            out[f"/run/secrets/{s}"] = s
        else:
            out[s["target"]] = s["source"]
    return out


def test_kafka_is_kraft_and_admits_only_authenticated_principals_over_tls(
    kafka_files: Path,
) -> None:
    compose = load()
    kafka = compose["services"]["kafka"]
    assert kafka["command"] == ["bash", "/run/secrets/kafka_start"]
    mounted = mounted_secrets(kafka)
    for name, file in (
        ("kafka_start", "start-kafka.sh"),
        ("kafka_server_properties", "server.properties"),
        ("kafka_broker_pem", "broker.pem"),
        ("kafka_ca", "ca.pem"),
        ("kafka_admin_properties", "admin.properties"),
    ):
        assert mounted[f"/run/secrets/{name}"] == name
        assert compose["secrets"][name] == {"file": f"./secrets/kafka/{file}"}
    conf = properties(kafka_files / "server.properties")
    assert conf["process.roles"] == "broker,controller"
    assert conf["auto.create.topics.enable"] == "false"
    # Every path the broker reads is a secret compose mounts in its container.
    for key in ("ssl.keystore.location", "ssl.truststore.location"):
        assert conf[key] in mounted, key
    assert "/run/secrets/kafka_server_properties" in (kafka_files / "start-kafka.sh").read_text()
    advertised = listeners(conf["advertised.listeners"])
    bound = listeners(conf["listeners"])
    protocols = dict(p.split(":") for p in conf["listener.security.protocol.map"].split(","))
    assert set(bound) == set(protocols)
    for name, (_, port) in advertised.items():
        assert bound[name][1] == port, name
        assert protocols[name] == "SASL_SSL", name  # every listener a client reaches
    assert advertised["HOST"] == ("127.0.0.1", 9092)  # processes on the host
    assert advertised["INTERNAL"] == ("kafka", 19092)  # containers
    assert conf["inter.broker.listener.name"] in advertised
    # The controller listener is this process's alone, and still logs in.
    assert bound["CONTROLLER"][0] == "localhost"
    assert protocols["CONTROLLER"] == "SASL_PLAINTEXT"
    assert conf["sasl.enabled.mechanisms"] == "SCRAM-SHA-512"
    assert conf["ssl.endpoint.identification.algorithm"] == "https"
    assert conf["authorizer.class.name"].endswith("StandardAuthorizer")
    assert conf["allow.everyone.if.no.acl.found"] == "false"
    assert conf["super.users"] == "User:admin"
    assert kafka["ports"] == ["127.0.0.1:9092:9092"]
    health = kafka["healthcheck"]["test"]
    assert "/run/secrets/kafka_admin_properties" in health  # the check logs in too


def test_the_acls_are_applied_once_before_any_service_starts() -> None:
    compose = load()
    acls = compose["services"]["kafka-acls"]
    assert acls["command"] == ["bash", "/run/secrets/kafka_acls"]
    assert acls["restart"] == "no"
    assert acls["depends_on"]["kafka"]["condition"] == "service_healthy"
    assert set(mounted_secrets(acls).values()) == {
        "kafka_acls",
        "kafka_admin_properties",
        "kafka_ca",
    }
    for name, service in seawall_services(compose).items():
        condition = service["depends_on"]["kafka-acls"]["condition"]
        assert condition == "service_completed_successfully", name


PRINCIPAL_OF_MODULE = {
    "services.ingress": INGRESS,
    "services.admission": ADMISSION,
    "services.controller": CONTROLLER,
    "services.workers": WORKERS,
}


def test_each_service_logs_in_as_its_own_principal_with_its_password_only(
    kafka_files: Path,
) -> None:
    compose = load()
    conf = properties(kafka_files / "server.properties")
    internal = "{}:{}".format(*listeners(conf["advertised.listeners"])["INTERNAL"])
    services = seawall_services(compose)
    assert services
    for name, service in services.items():
        env = environment(service)
        principal = PRINCIPAL_OF_MODULE[module_of(service)]
        assert env["SEAWALL_KAFKA_BOOTSTRAP"] == internal, name
        assert env["SEAWALL_KAFKA_SECURITY_PROTOCOL"] == "SASL_SSL", name
        assert env["SEAWALL_KAFKA_SASL_MECHANISM"] == "SCRAM-SHA-512", name
        assert env["SEAWALL_KAFKA_SASL_USERNAME"] == principal, name
        assert env["SEAWALL_KAFKA_SSL_CAFILE"] == "/run/secrets/kafka_ca", name
        mounted = mounted_secrets(service)
        assert mounted["/run/secrets/kafka_ca"] == "kafka_ca", name
        source = mounted[env["SEAWALL_KAFKA_SASL_PASSWORD_FILE"]]
        assert compose["secrets"][source] == {"file": f"./secrets/kafka/{principal}.password"}
        others = {s for s in mounted.values() if s.startswith("kafka_password")} - {source}
        assert not others, name
        # The broker knows the principal: start-kafka.sh adds its SCRAM credential.
        assert f"name={principal}," in (kafka_files / "start-kafka.sh").read_text(), name


def test_every_seawall_service_reaches_kafka_and_redis_inside_the_network() -> None:
    compose = load()
    services = seawall_services(compose)
    assert services
    for name, service in services.items():
        env = environment(service)
        assert env["SEAWALL_KAFKA_IDEMPOTENCE"] == "true", name  # Apache Kafka
        redis = re.fullmatch(r"redis://([^:/]+):6379/\d+", env["SEAWALL_REDIS_URL"])
        assert redis is not None, name
        assert redis.group(1) in compose["services"], name
        for dependency in ("kafka", "redis"):
            assert service["depends_on"][dependency]["condition"] == "service_healthy", name
            assert compose["services"][dependency]["healthcheck"]["test"], dependency


def test_every_seawall_service_gets_settings_it_accepts(load_settings: LoadSettings) -> None:
    """Each service's environment, variables at their defaults, loads into its settings
    and names only settings that exist."""
    for name, service in seawall_services(load()).items():
        env = {k: interpolate(v) for k, v in environment(service).items()}
        loaded = load_settings(module_of(service), env)
        assert loaded.kafka_bootstrap == env["SEAWALL_KAFKA_BOOTSTRAP"], name
        assert loaded.redis_url == env["SEAWALL_REDIS_URL"], name
        if module_of(service) == "services.workers":
            assert loaded.pool in loaded.pools, name


def test_the_default_fleet_is_simulated() -> None:
    compose = load()
    workers = {
        name: s
        for name, s in seawall_services(compose).items()
        if module_of(s) == "services.workers" and "profiles" not in s
    }
    fleet = {
        name: (
            environment(s)["SEAWALL_POOL"],
            environment(s).get("SEAWALL_ENGINE", "sim"),
            environment(s)["SEAWALL_SIM_MODEL"],
            s["deploy"]["replicas"],
        )
        for name, s in workers.items()
    }
    assert fleet == {
        "worker-main": ("main", "sim", "llama-2-7b", 2),
        "worker-small": ("small", "sim", "llama-3.2-1b", 1),
        "worker-main-dedicated": ("main-dedicated", "sim", "llama-2-7b", 1),
    }
    for name, service in seawall_services(compose).items():
        env = environment(service)
        assert set(env["SEAWALL_POOLS"].split(",")) == {"main", "small", "main-dedicated"}
        if "profiles" not in service:
            assert "devices" not in str(service.get("deploy", {})), name
    for name in ("ingress", "admission", "controller"):
        assert "profiles" not in compose["services"][name]
    enterprise = environment(compose["services"]["admission"])["SEAWALL_ENTERPRISE_POOLS"]
    assert json.loads(enterprise) == {"main": "main-dedicated"}


def test_the_gpu_profile_runs_a_vllm_worker_on_an_nvidia_gpu() -> None:
    compose = load()
    gpu = {name: s for name, s in compose["services"].items() if "gpu" in s.get("profiles", [])}
    assert list(gpu) == ["worker-vllm"]
    worker = gpu["worker-vllm"]
    assert worker["profiles"] == ["gpu"]
    env = environment(worker)
    assert env["SEAWALL_ENGINE"] == "vllm"
    assert env["SEAWALL_POOL"] in env["SEAWALL_POOLS"].split(",")
    # The model is the operator's choice, with a default.
    model = INTERPOLATION.fullmatch(env["SEAWALL_VLLM_MODEL"])
    assert model is not None
    assert model.group(1) == "SEAWALL_VLLM_MODEL"
    assert interpolate(env["SEAWALL_VLLM_MODEL"])
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device == {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}
    # An image with vLLM in it: the Dockerfile's EXTRAS names pyproject's extras.
    assert worker["build"]["args"]["EXTRAS"] == "vllm"
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG EXTRAS=", dockerfile, re.M)
    assert '".${EXTRAS:+[$EXTRAS]}"' in dockerfile
    assert 'vllm = ["vllm' in (ROOT / "pyproject.toml").read_text()
    assert worker["image"] != compose["services"]["worker-main"]["image"]


def test_the_key_pepper_is_a_secret_from_a_file_git_ignores() -> None:
    compose = load()
    assert compose["secrets"]["key_pepper"] == {"file": "./secrets/key_pepper"}
    ingress = compose["services"]["ingress"]
    assert "key_pepper" in ingress["secrets"]
    assert environment(ingress)["SEAWALL_KEY_PEPPER_FILE"] == "/run/secrets/key_pepper"
    ignored = (ROOT / ".gitignore").read_text().split()
    assert "compose/secrets/" in ignored
    # Nor does it go into the image: the build context is the repository.
    assert "compose/secrets" in (ROOT / ".dockerignore").read_text().split()


def test_each_service_gets_only_the_keys_of_its_roles_and_hops() -> None:
    """Followers get trusted.pub and the private key of their role only; each side of a
    signed hop (services.common.hop_signing) its secret: ingress and admission the
    requests hop's, admission and the workers the dispatch hop's."""
    compose = load()
    secrets = compose["secrets"]
    assert all(v["file"].startswith("./secrets/") for v in secrets.values())
    keys_dir = compose["x-seawall-env"]["SEAWALL_CONTROL_KEYS_DIR"]
    own = {"admission": None, "controller": "controller"}
    own |= {name: "worker" for name in compose["services"] if name.startswith("worker-")}
    for name, role in own.items():
        mounted = {
            target: source
            for target, source in mounted_secrets(compose["services"][name]).items()
            if not source.startswith("kafka_")  # Kafka's (the test above)
        }
        expected = {
            f"{keys_dir}/trusted.pub": "control_trusted",
            # the workers MAC their reports, admission and the controller check them
            f"{keys_dir}/telemetry.hmac": "hop_telemetry",
        }
        if role is not None:
            expected[f"{keys_dir}/{role}.key"] = f"control_{role}_key"
        if role != "controller":  # admission and the workers sample (next test)
            expected[SAMPLING_TARGET] = "sampling_secret"
            expected[f"{keys_dir}/dispatch.hmac"] = "hop_dispatch"
        if name == "admission":
            expected[f"{keys_dir}/requests.hmac"] = "hop_requests"
            expected[f"{keys_dir}/hints.hmac"] = "hop_hints"
        if role != "controller":  # the controller needs no Redis here (next tests)
            expected[REDIS_PASSWORD] = "redis_password"
        assert mounted == expected, name
    # Ingress follows no control event: of the keys, two hops' secrets only.
    ingress = compose["services"]["ingress"]["secrets"]
    assert {"source": "hop_requests", "target": f"{keys_dir}/requests.hmac"} in ingress
    assert {"source": "hop_hints", "target": f"{keys_dir}/hints.hmac"} in ingress
    assert len(ingress) == 6  # those, the pepper, Redis's password, Kafka's and its CA


REDIS_PASSWORD = "/run/secrets/redis_password"


def test_redis_admits_only_logged_in_users_and_the_services_log_in() -> None:
    """Redis runs with `seawall redis-acl`'s file (its default user off), on the host's
    loopback only; every service that uses Redis logs in as `seawall` with the password
    from a secret file; the controller, whose only use of Redis is the embedded broker's
    doorbell (off here), gets no password."""
    compose = load()
    redis = compose["services"]["redis"]
    command = redis["command"]
    assert command[command.index("--aclfile") + 1] == "/run/secrets/redis_acl"
    assert compose["secrets"]["redis_acl"] == {"file": "./secrets/redis/users.acl"}
    assert compose["secrets"]["redis_password"] == {"file": "./secrets/redis/seawall.password"}
    assert redis["ports"] == ["127.0.0.1:6379:6379"]
    health = " ".join(redis["healthcheck"]["test"])
    assert "--user seawall" in health
    assert REDIS_PASSWORD in health
    for name, service in seawall_services(compose).items():
        env = environment(service)
        sources = [s["source"] if isinstance(s, dict) else s for s in service.get("secrets", [])]
        if module_of(service) == "services.controller":
            assert "SEAWALL_REDIS_PASSWORD_FILE" not in env, name
            assert "redis_password" not in sources, name
            assert env.get("SEAWALL_KAFKA_DOORBELL", "false") == "false", name
            continue
        assert env["SEAWALL_REDIS_USERNAME"] == "seawall", name
        assert env["SEAWALL_REDIS_PASSWORD_FILE"] == REDIS_PASSWORD, name
        assert {"source": "redis_password", "target": REDIS_PASSWORD} in service["secrets"], name


def test_nothing_but_ingress_is_published_beyond_the_hosts_loopback() -> None:
    for name, service in load()["services"].items():
        for port in service.get("ports", []):
            if name != "ingress":
                assert str(port).startswith("127.0.0.1:"), (name, port)


SAMPLING_TARGET = "/run/secrets/sampling_secret"


def test_admission_and_every_worker_share_the_sampling_secret_and_nothing_else_gets_it() -> None:
    """The canary split and the shadow sample are keyed with one fleet-wide secret
    (services.common.sampling): every process that samples must read the same file, or
    two of them would decide apart; ingress and the controller never need it."""
    compose = load()
    assert compose["secrets"]["sampling_secret"] == {"file": "./secrets/sampling_secret"}
    sampling = {
        name
        for name, s in seawall_services(compose).items()
        if module_of(s) in ("services.admission", "services.workers")
    }
    assert {"admission", "worker-main", "worker-small", "worker-vllm"} <= sampling
    for name, service in seawall_services(compose).items():
        env = environment(service)
        sources = [s["source"] if isinstance(s, dict) else s for s in service.get("secrets", [])]
        if name in sampling:
            assert env["SEAWALL_SAMPLING_SECRET_FILE"] == SAMPLING_TARGET, name
            mounted = {"source": "sampling_secret", "target": SAMPLING_TARGET}
            assert mounted in service["secrets"], name
        else:
            assert "SEAWALL_SAMPLING_SECRET_FILE" not in env, name
            assert "sampling_secret" not in sources, name
    # git-ignored, like the pepper (compose/secrets/), and never in the image
    assert "compose/secrets/" in (ROOT / ".gitignore").read_text().split()


def test_no_secret_is_written_in_the_file() -> None:
    compose = load()
    for name, service in compose["services"].items():
        env = environment(service)
        assert "SEAWALL_KEY_PEPPER" not in env, name
        for key, value in env.items():
            if re.search(r"PEPPER|PASSWORD|TOKEN|SECRET|_KEY$", key):
                # Empty, from the environment of `docker compose`, or a file's path.
                assert INTERPOLATION.fullmatch(value) or value.startswith("/run/secrets/"), (
                    name,
                    key,
                )
                assert interpolate(value) == "" or value.startswith("/run/secrets/"), (name, key)
    # Nothing that looks like a key anywhere (hex or base64 of 128 bits or more).
    assert not re.search(r"[0-9a-fA-F]{32,}|[A-Za-z0-9+/]{40,}={0,2}", COMPOSE.read_text())


def test_the_services_stop_gracefully_and_say_when_they_are_healthy() -> None:
    compose = load()
    for name, service in seawall_services(compose).items():
        grace = float(environment(service)["SEAWALL_SHUTDOWN_GRACE_S"])
        assert seconds(service["stop_grace_period"]) >= grace + 5, name
        assert service["restart"] == "unless-stopped", name
        probe = " ".join(service["healthcheck"]["test"])
        if name == "ingress":
            assert "http://127.0.0.1:8080/health" in probe
        else:
            port = environment(service)["SEAWALL_METRICS_PORT"]
            assert f"http://127.0.0.1:{port}/metrics" in probe, name
    ingress = compose["services"]["ingress"]
    env = environment(ingress)
    assert env["SEAWALL_INGRESS_HOST"] == "0.0.0.0"
    assert f"{env['SEAWALL_INGRESS_PORT']}:{env['SEAWALL_INGRESS_PORT']}" in ingress["ports"]


def test_prometheus_scrapes_every_seawall_service_and_alerts_through_alertmanager() -> None:
    compose = load()
    prometheus = compose["services"]["prometheus"]
    config_path = "/etc/prometheus/prometheus.yml"
    assert f"--config.file={config_path}" in prometheus["command"]
    volumes = mounts(prometheus)
    assert volumes[config_path] == "deploy/prometheus/prometheus.yml"
    assert volumes["/etc/prometheus/rules"] == "deploy/prometheus"
    config = yaml.safe_load((ROOT / volumes[config_path]).read_text())

    # The rules of deploy/prometheus/*.rules.yml, not this configuration beside them.
    (rule_glob,) = config["rule_files"]
    directory, pattern = PurePosixPath(rule_glob).parent, PurePosixPath(rule_glob).name
    assert str(directory) == "/etc/prometheus/rules"
    assert fnmatch.fnmatch("seawall.rules.yml", pattern)
    assert not fnmatch.fnmatch("prometheus.yml", pattern)

    scraped: dict[str, int] = {}
    for job in config["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            assert sd["type"] == "A"  # every replica, not one
            scraped |= dict.fromkeys(sd["names"], sd["port"])
    for name, service in seawall_services(compose).items():
        env = environment(service)
        assert scraped.get(name) == int(env["SEAWALL_METRICS_PORT"]), name
        if name == "ingress":  # never on the public API's port
            assert env["SEAWALL_METRICS_PORT"] != env["SEAWALL_INGRESS_PORT"]
    assert set(scraped) <= set(compose["services"])

    (alerting,) = config["alerting"]["alertmanagers"]
    (target,) = alerting["static_configs"][0]["targets"]
    host, port = target.split(":")
    alertmanager = compose["services"][host]
    assert f"127.0.0.1:{port}:{port}" in alertmanager["ports"]
    assert mounts(alertmanager) == {
        "/etc/alertmanager/alertmanager.yml": "deploy/alertmanager/alertmanager.yml"
    }
    assert "--config.file=/etc/alertmanager/alertmanager.yml" in alertmanager["command"]


def test_grafana_is_provisioned_with_prometheus_and_the_dashboards() -> None:
    compose = load()
    grafana = compose["services"]["grafana"]
    volumes = mounts(grafana)
    assert volumes["/etc/grafana/provisioning"] == "deploy/grafana/provisioning"
    provisioning = ROOT / volumes["/etc/grafana/provisioning"]
    (source,) = yaml.safe_load((provisioning / "datasources/prometheus.yml").read_text())[
        "datasources"
    ]
    assert source["type"] == "prometheus"
    assert source["url"] == "http://prometheus:9090"
    assert "prometheus" in compose["services"]
    (provider,) = yaml.safe_load((provisioning / "dashboards/seawall.yml").read_text())["providers"]
    assert provider["type"] == "file"
    dashboards = provider["options"]["path"]
    assert volumes[dashboards] == "deploy/grafana/dashboards"


def test_every_service_exports_its_spans_to_jaeger_which_grafana_reads() -> None:
    compose = load()
    jaeger = compose["services"]["jaeger"]
    assert jaeger["image"].startswith("jaegertracing/jaeger:2.")
    assert "--set=receivers.otlp.protocols.http.endpoint=0.0.0.0:4318" in jaeger["command"]
    for name, service in seawall_services(compose).items():
        assert environment(service)["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318", name
    provisioning = ROOT / mounts(compose["services"]["grafana"])["/etc/grafana/provisioning"]
    (source,) = yaml.safe_load((provisioning / "datasources/jaeger.yml").read_text())["datasources"]
    assert source["type"] == "jaeger"
    assert source["url"] == "http://jaeger:16686"
    assert "jaeger" in compose["services"]["grafana"]["depends_on"]


def test_the_image_runs_as_a_user_and_leaves_the_command_to_each_service() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    instructions = [
        line.split(None, 1)
        for line in dockerfile.splitlines()
        if line.strip() and not line.startswith((" ", "#"))
    ]
    keywords = [i[0] for i in instructions]
    assert instructions[0] == ["FROM", "python:3.11-slim"]
    assert "ENTRYPOINT" not in keywords
    assert "CMD" not in keywords
    (user,) = [i[1] for i in instructions if i[0] == "USER"]
    uid = user.split(":")[0]
    assert uid.isdigit()  # numeric: Kubernetes' runAsNonRoot checks it
    assert int(uid) != 0
    assert keywords.index("USER") == len(keywords) - 1
    assert "pip install --no-cache-dir" in dockerfile
    ignored = (ROOT / ".dockerignore").read_text().split()
    for path in (".venv", ".git", ".seawall", "bench/out", "**/__pycache__"):
        assert path in ignored


def test_the_interpolation_helper() -> None:
    assert interpolate("${A:-x}/${B:-}/$${C}") == "x//${C}"
