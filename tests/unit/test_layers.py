"""The layers of ARCHITECTURE.md, checked on every import of the code: the client
distribution needs nothing of the servers, nothing under ``services/`` imports the CLI,
and no service imports another."""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).parents[2]
CLIENT_DEPENDENCIES = {"aiokafka", "pydantic", "pydantic_core", "schemas", "seawall_client"}
"""What ``client/pyproject.toml`` installs (pydantic_core comes with pydantic)."""


def imports(path: Path) -> Iterator[str]:
    """The absolute module names ``path`` imports, at any depth of its code."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module


def sources(folder: str) -> list[Path]:
    found = sorted((ROOT / folder).rglob("*.py"))
    assert found, f"no Python under {folder}"
    return found


def test_the_client_distribution_imports_only_its_dependencies() -> None:
    allowed = CLIENT_DEPENDENCIES | set(sys.stdlib_module_names)
    strays = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in sources("client/src")
        for name in imports(path)
        if name.split(".")[0] not in allowed
    }
    assert strays == set()


def test_nothing_under_services_imports_the_cli() -> None:
    strays = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in sources("services")
        for name in imports(path)
        if name.split(".")[0] == "seawall"
    }
    assert strays == set()


def test_no_service_imports_another_and_common_imports_none() -> None:
    strays = set()
    for path in sources("services"):
        own = path.relative_to(ROOT / "services").parts[0]
        for name in imports(path):
            parts = name.split(".")
            if parts[0] == "services" and len(parts) > 1 and parts[1] not in {own, "common"}:
                strays.add(f"{path.relative_to(ROOT)}: {name}")
    assert strays == set()
