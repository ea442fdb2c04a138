"""The end-to-end tier: the stack as a user runs it (``tests.stack``); the ``stack``
fixture is one ``seawall up`` shared by a test module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.stack import Stack, launch


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Stack]:
    with launch(
        tmp_path_factory.mktemp("stack"), redis_url, "--workers", "1", "--small-workers", "1"
    ) as s:
        yield s
