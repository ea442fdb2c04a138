"""``seawall --help`` lists every command, wherever its module defines it (the CLI is
split over cli.py, keys.py, steer_cli.py and incident_cli.py)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from seawall.cli import app

pytestmark = pytest.mark.unit

COMMANDS = [
    "up",
    "sim-serve",
    "alerts",
    "events",
    "submit",
    "load",
    "status",
    "export-schemas",
    "profile",
    "record",
    "replay",
    "report",
    "keys",
    "quota",
    "region",
    "canary",
]


def test_the_help_lists_every_command() -> None:
    result = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    listed = {line.strip("│ ").split(" ")[0] for line in result.output.splitlines()}
    assert set(COMMANDS) <= listed


@pytest.mark.parametrize(
    ("group", "commands"),
    [
        ("keys", ["create", "list", "rotate", "revoke"]),
        ("quota", ["set", "clear", "list"]),
        ("region", ["throttle", "lift", "list"]),
        ("canary", ["start", "promote", "abort", "status"]),
    ],
)
def test_each_group_lists_its_commands(group: str, commands: list[str]) -> None:
    result = CliRunner().invoke(app, [group, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    listed = {line.strip("│ ").split(" ")[0] for line in result.output.splitlines()}
    assert set(commands) <= listed
