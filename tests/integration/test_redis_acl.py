"""Redis with ACL users (``seawall redis-acl``), on a real ``redis-server``: a client
that does not log in runs nothing, the services' user reaches only its deployment's keys
and channels and no administrative command, and a request crosses ingress, admission and
a worker (doorbell on) logged in as that user."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from prometheus_client import REGISTRY
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError

from schemas import Tier
from seawall import embedded
from seawall.redis_acl import ACL_FILE, ADMIN_USER, SERVICE_USER, password_file, write_acl
from services.common.settings import CommonSettings
from services.ingress.service import IngressService
from tests.admission_helpers import admission_settings, started
from tests.fleet import sim_worker, worker_settings
from tests.integration.ingress.conftest import ingress_settings, new_key, stream_chat

pytestmark = pytest.mark.integration


@contextlib.contextmanager
def acl_redis(directory: Path, prefix: str) -> Iterator[str]:
    """A ``redis-server`` on a free port started with ``seawall redis-acl``'s file for
    ``prefix``; its URL (no credentials in it)."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("no redis-server binary")
    acl = write_acl(directory, prefix)
    port = embedded.free_port()
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--aclfile",
            str(acl),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 10
        while not embedded.port_in_use("127.0.0.1", port):
            assert proc.poll() is None, "redis-server refused the ACL file"
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


def login(url: str, directory: Path, user: str) -> redis.Redis:
    password = password_file(directory, user).read_text().strip()
    return redis.Redis.from_url(url, username=user, password=password)


def test_the_acl_keeps_the_services_user_to_its_keys_and_commands(tmp_path: Path) -> None:
    with acl_redis(tmp_path, "seawall:") as url:
        anonymous = redis.Redis.from_url(url)
        with pytest.raises((AuthenticationError, ResponseError), match=r"NOAUTH|authenticated"):
            anonymous.ping()
        wrong = redis.Redis.from_url(url, username=SERVICE_USER, password="guess")
        with pytest.raises(AuthenticationError):
            wrong.ping()

        service = login(url, tmp_path, SERVICE_USER)
        assert service.set("seawall:quota:acme", 1)
        assert service.publish("seawall:doorbell:llm.requests.high", b"") == 0
        with pytest.raises(NoPermissionError):
            service.set("other-app:data", 1)
        with pytest.raises(NoPermissionError):
            service.publish("other-app:channel", b"")
        # A script is held to the same key patterns for every key it touches.
        with pytest.raises(ResponseError, match=r"can.t access at least one of the keys"):
            service.eval("return redis.call('GET', 'other-app:data')", 0)
        for command in (
            ("FLUSHALL",),
            ("CONFIG", "GET", "requirepass"),
            ("KEYS", "*"),
            ("ACL", "LIST"),
            ("SHUTDOWN",),
        ):
            with pytest.raises(NoPermissionError):
                service.execute_command(*command)

        admin = login(url, tmp_path, ADMIN_USER)
        assert admin.get("seawall:quota:acme") == b"1"
        assert len(admin.acl_list()) == 3
    acl_text = (tmp_path / ACL_FILE).read_text()
    for user in (SERVICE_USER, ADMIN_USER):  # hashes only: the file reveals no password
        assert password_file(tmp_path, user).read_text().strip() not in acl_text
        assert password_file(tmp_path, user).stat().st_mode & 0o077 == 0


def test_a_password_in_the_url_and_a_password_file_are_refused_together(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text("pw-7f3a9c\n")
    with pytest.raises(ValueError, match="give the password once"):
        CommonSettings(redis_url="redis://:pw@127.0.0.1:6379/0", redis_password_file=secret)
    settings = CommonSettings(redis_username="seawall", redis_password_file=secret)
    assert settings.redis_credentials == {"username": "seawall", "password": "pw-7f3a9c"}
    assert "pw-7f3a9c" not in repr(settings)


async def test_a_request_crosses_the_fleet_logged_in_as_the_services_user(
    settings: CommonSettings, tmp_path: Path
) -> None:
    with acl_redis(tmp_path, settings.redis_prefix) as url:
        logged_in = CommonSettings(
            **{
                **settings.model_dump(),
                "redis_url": url,
                "redis_username": SERVICE_USER,
                "redis_password_file": password_file(tmp_path, SERVICE_USER),
                "kafka_doorbell": True,
            }
        )
        from services.admission.service import Admission

        ingress = IngressService(ingress_settings(logged_in))
        admission = Admission(admission_settings(logged_in))
        worker = sim_worker(worker_settings(logged_in))
        rings = REGISTRY.get_sample_value("seawall_doorbell_rings_total") or 0.0
        async with started(ingress, admission, worker):
            key = await new_key(ingress.keystore, "acl-co", Tier.PRO)
            answer = await stream_chat(ingress.port, {"Authorization": f"Bearer {key}"}, 16)
            assert answer.status == 200
            events = answer.events
        assert events[-1] == "data: [DONE]"
        assert any(json.loads(e[6:]).get("choices") for e in events[:-1])
        # The doorbell rang through the same login (a ring is counted once Redis took it),
        # and everything the fleet wrote is under the deployment's prefix.
        assert (REGISTRY.get_sample_value("seawall_doorbell_rings_total") or 0.0) > rings
        admin = login(url, tmp_path, ADMIN_USER)
        written = [k.decode() for k in admin.scan_iter(count=1000)]
        assert written
        assert all(k.startswith(settings.redis_prefix) for k in written)


def test_the_command_keeps_existing_passwords_and_follows_the_prefix(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from seawall.cli import app

    first = CliRunner().invoke(app, ["redis-acl", str(tmp_path)])
    assert first.exit_code == 0, first.output
    password = password_file(tmp_path, SERVICE_USER).read_text()
    again = CliRunner().invoke(app, ["redis-acl", str(tmp_path), "--prefix", "prod:"])
    assert again.exit_code == 0, again.output
    assert password_file(tmp_path, SERVICE_USER).read_text() == password  # never replaced
    assert "~prod:* &prod:*" in (tmp_path / ACL_FILE).read_text()
    refused = CliRunner().invoke(app, ["redis-acl", str(tmp_path), "--prefix", "a b*"])
    assert refused.exit_code != 0
