"""Export the JSON Schema of every top-level message into ``json/`` beside this module.

``python -m schemas.export`` writes the files; ``--check`` exits 1 when they differ
from the models (the test suite runs the same comparison).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from schemas import TOP_LEVEL
from schemas.base import Message

JSON_DIR = Path(__file__).parent / "json"


def schema_of(model: type[Message]) -> dict[str, Any]:
    schema = model.model_json_schema(mode="validation")
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = f"seawall/{model.__name__}.schema.json"
    return schema


def render(model: type[Message]) -> str:
    return json.dumps(schema_of(model), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def expected_files() -> dict[str, str]:
    return {f"{m.__name__}.schema.json": render(m) for m in TOP_LEVEL}


def stale_files(directory: Path = JSON_DIR) -> list[str]:
    """Files that are missing, differ from the models, or belong to no model."""
    expected = expected_files()
    present = {p.name for p in directory.glob("*.schema.json")}
    stale = [
        n
        for n, text in expected.items()
        if not (directory / n).is_file() or (directory / n).read_text() != text
    ]
    return sorted(stale + sorted(present - expected.keys()))


def write(directory: Path = JSON_DIR) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    expected = expected_files()
    for p in directory.glob("*.schema.json"):
        if p.name not in expected:
            p.unlink()
    for name, text in expected.items():
        (directory / name).write_text(text)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if "--check" in args:
        stale = stale_files()
        for name in stale:
            print(f"stale: schemas/json/{name}", file=sys.stderr)
        return 1 if stale else 0
    write()
    print(f"wrote {len(TOP_LEVEL)} schemas to {JSON_DIR}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
