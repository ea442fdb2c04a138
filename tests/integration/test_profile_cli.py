"""``seawall profile`` on the real broker: the command asks a running simulated worker,
the worker profiles its event loop while serving, writes a readable ``pstats`` trace and
says where on the control topic."""

from __future__ import annotations

import asyncio
import pstats
from pathlib import Path

from seawall_client.topics import Topics
from services.common.settings import CommonSettings
from tests.integration.controller.test_controller import load, worker
from tests.integration.test_steer_cli import seawall


async def test_a_worker_profiles_itself_on_request(
    settings: CommonSettings, topics: Topics, tmp_path: Path
) -> None:
    async with worker(settings, instance_id="w-prof", profile_dir=tmp_path):
        await asyncio.sleep(3)  # joined, following the control topic
        asked = asyncio.create_task(
            asyncio.to_thread(seawall, settings, "profile", "--worker", "w-prof", "--seconds", "3")
        )
        await asyncio.sleep(1.5)  # the worker has the request: it serves while profiled
        await load(settings, topics, 60, max_tokens=60)
        out = await asked
    assert "profile of w-prof:" in out
    path = Path(out.rsplit(": ", 1)[1].strip())
    assert path.parent == tmp_path
    stats = pstats.Stats(str(path))
    files = {filename for (filename, _, _) in stats.stats}  # type: ignore[attr-defined]
    assert any("services/workers/engine/sim" in f for f in files)  # the engine's own work
    assert any("services/workers/service.py" in f for f in files)
    events = await asyncio.to_thread(seawall, settings, "events", "--kind", "profile")
    assert "requested" in events
    assert "written" in events
