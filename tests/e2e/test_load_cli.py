"""``seawall submit`` and ``seawall load`` against the whole stack, as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

from tests.stack import Stack


def test_submit_streams_the_text_then_a_summary(stack: Stack) -> None:
    issued = stack.key("submit-cli", "enterprise")
    out = stack.cli("submit", "--key", issued["key"], "--max-tokens", "12", "tell me a story")
    assert len(out.stdout.split()) == 12  # the simulator writes one word per token
    summary = out.stderr.strip().splitlines()[-1]
    assert summary.startswith("status=ok reason=none ")
    assert "completion_tokens=12" in summary
    assert "attempts=1" in summary
    assert issued["key"] not in out.stdout + out.stderr


def test_submit_json_and_the_exit_code_of_a_refusal(stack: Stack) -> None:
    issued = stack.key("submit-cli-json", "pro")
    out = stack.cli(
        "submit", "--key", issued["key"], "--json", "--no-stream", "--max-tokens", "5", "hi"
    )
    reply = json.loads(out.stdout)
    assert (reply["status"], reply["completion_tokens"]) == ("ok", 5)

    stack.cli("keys", "revoke", issued["key_id"])  # its signature is still good: it is told
    time.sleep(2.5)  # ingress keeps a key record it read for SEAWALL_KEY_CACHE_S (2 s)
    refused = subprocess.run(
        [sys.executable, "-m", "seawall.cli", "submit", "--key", issued["key"], "hello"],
        env=stack.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 1
    assert "status=rejected reason=unauthenticated" in refused.stderr


def test_load_answers_every_request_with_keys_of_its_own(stack: Stack, tmp_path: Path) -> None:
    prefix = f"e2e-load-{uuid.uuid4().hex[:6]}"
    common = ["load", "--tenants", "3", "--tenant-prefix", prefix, "--max-tokens", "16"]
    first = tmp_path / "first.json"
    out = stack.cli(
        *common,
        *("--profile", "burst", "--duration", "10", "--rate", "1", "--drain", "60"),
        *("--out", str(first)),
        timeout_s=240,
    )
    doc = json.loads(first.read_text())
    assert doc["submitted"] > 0
    assert doc["terminal_replies"] == doc["submitted"]
    assert doc["lost"] == 0
    assert doc["client"]["submitted"] == doc["submitted"]
    assert set(doc["classes"]) <= {"vip", "standard", "bulk", "all"}
    assert doc["classes"]["all"]["submitted"] == doc["submitted"]
    assert [t["tier"] for t in doc["config"]["tenant_keys"]] == ["basic", "pro", "enterprise"]
    assert "requests by priority class" in out.stdout

    # a key per tenant and run, revoked when the run ends (the store keeps no secrets)
    listed = stack.cli("keys", "list", "--json").stdout
    phases = {k["key_id"]: k["phase"] for k in json.loads(listed)}
    assert {phases[k["key_id"]] for k in doc["config"]["tenant_keys"]} == {"revoked"}
    second = tmp_path / "second.json"
    stack.cli(*common, "--duration", "1", "--rate", "2", "--out", str(second), timeout_s=120)
    again = json.loads(second.read_text())
    first_ids = {k["key_id"] for k in doc["config"]["tenant_keys"]}
    assert first_ids.isdisjoint(k["key_id"] for k in again["config"]["tenant_keys"])
    assert again["terminal_replies"] == again["submitted"]
