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
    """The absolute names ``path`` imports, at any depth of its code (``from m import x``
    gives ``m.x``: ``x`` may be a module)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield from (f"{node.module}.{a.name}" for a in node.names)


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


POLICY_MAY_IMPORT = {
    "pydantic",
    "ddsketch",
    "schemas",
    "seawall_client.clock",
    "seawall_client.signing",
    "seawall_client.topics",
    "services.common.control_state",
    "services.common.sketch",
    "services.common.tokenizer",
    "services.workers.engine.base",
}
"""What a policy module may import besides its own ``policy`` package and the standard
library: the wire contract and other pure modules (no I/O, no clock reads)."""
STDLIB_WITH_EFFECTS = {
    "asyncio",
    "datetime",
    "http",
    "logging",
    "os",
    "select",
    "socket",
    "ssl",
    "subprocess",
    "threading",
    "time",
    "urllib.request",
}
"""Standard modules that do I/O or read the clock: a policy takes ``now`` and returns
what to do, and its shell does the rest."""


def test_every_policy_module_is_pure() -> None:
    policies = sorted((ROOT / "services").glob("*/policy"))
    assert {p.parent.name for p in policies} == {"admission", "controller", "ingress", "workers"}
    strays = set()
    for folder in policies:
        own = f"services.{folder.parent.name}.policy"
        for path in sorted(folder.rglob("*.py")):
            for name in imports(path):
                top = name.split(".")[0]
                if name.startswith((f"{own}.", "__future__.")):
                    continue
                if top in sys.stdlib_module_names:
                    if top in STDLIB_WITH_EFFECTS or name in STDLIB_WITH_EFFECTS:
                        strays.add(f"{path.relative_to(ROOT)}: {name}")
                elif not any(name == m or name.startswith(f"{m}.") for m in POLICY_MAY_IMPORT):
                    strays.add(f"{path.relative_to(ROOT)}: {name}")
    assert strays == set()
