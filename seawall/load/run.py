"""``seawall load``, the shell: keys for the synthetic tenants, one client per tenant,
requests sent at their planned times (never waiting for replies), a drain, the results.

Keys are created through the key store as ``seawall keys create`` does, one per tenant
and run (the clients sign with the key, which the store never keeps, so a run cannot
reuse an earlier run's), and revoked when the run ends.
"""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from collections.abc import Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

from aiokafka.errors import KafkaError
from redis.exceptions import RedisError
from rich.console import Console, RenderableType
from rich.live import Live
from rich.markup import escape

from schemas import TIER_PRIORITY, InferenceReply, ReasonCode, Tier
from seawall.keys import open_keystore
from seawall.load import display, profiles, stats
from seawall.load.profiles import PlannedRequest, Tenant
from seawall.traces import stage_quantiles, stage_table, traces_in
from seawall_client import ClientStats, ReplyRouterClosed, RetryPolicy, SeawallClient
from seawall_client.retry import attempt_of
from seawall_client.tracecontext import new_trace
from services.common.tracing import FLUSH_INTERVAL_S
from services.ingress.keystore import KeyStore
from services.ingress.policy.keys import IssuedKey
from services.ingress.settings import IngressSettings

REFRESH_S = 0.5


@dataclass(frozen=True, slots=True)
class LoadConfig:
    profile: profiles.Profile = "steady"
    duration_s: float = 60.0
    rate: float = 5.0
    """Requests per second; the base rate of the burst profile."""
    burst_multiplier: float = profiles.BURST_MULTIPLIER
    seed: int = 0
    tenants: int = 6
    tier_mix: Mapping[Tier, float] = field(default_factory=lambda: dict(profiles.DEFAULT_MIX))
    tenant_prefix: str = "load"
    prompts: profiles.PromptMix = field(default_factory=profiles.PromptMix)
    max_tokens: int = 64
    temperature: float = 1.0
    timeout_s: float = 30.0
    """Per request, retries included (the SDK's ``timeout_s``)."""
    drain_s: float = 30.0
    """How long to wait for replies once the last request is sent."""
    max_attempts: int = RetryPolicy().max_attempts

    def as_json(self) -> dict[str, object]:
        doc = asdict(self)
        doc["tier_mix"] = {tier.value: share for tier, share in self.tier_mix.items()}
        return doc


async def tenant_keys(store: KeyStore, tenants: Sequence[Tenant]) -> list[IssuedKey]:
    """A new key per tenant for this run (records are signed with the key itself, which
    the store never keeps, so a run cannot reuse an earlier run's). The tenant's tier is
    set to the planned one first (a no-op, and nothing audited, when it already is)."""
    issued = []
    for tenant in tenants:
        await store.set_policy(tenant.name, tier=tenant.tier)
        key, _ = await store.create(tenant.name)
        issued.append(key)
    return issued


async def revoke_keys(settings: IngressSettings, keys: Sequence[IssuedKey]) -> None:
    """The run's keys are of no use after it: revoked (and purged in due course)."""
    async with open_keystore(settings) as store:
        for k in keys:
            await store.revoke(k.record.key_id)


def _sum_stats(clients: Sequence[SeawallClient]) -> dict[str, int]:
    total: dict[str, int] = dict.fromkeys(asdict(ClientStats()), 0)
    for client in clients:
        for name, value in asdict(client.stats).items():
            total[name] += value
    return total


class _Run:
    """One run's clients and records; times are seconds from the first planned arrival."""

    def __init__(
        self, config: LoadConfig, tenants: Sequence[Tenant], clients: Sequence[SeawallClient]
    ) -> None:
        self.config = config
        self.tenants = tenants
        self.clients = clients
        self.run_id = uuid.uuid4().hex[:8]
        self.loop = asyncio.get_running_loop()
        self.start = self.loop.time()
        self.sent_at: list[float] = []
        self.finished: list[stats.Outcome] = []
        self.open: dict[int, tuple[PlannedRequest, float]] = {}
        self.trace_ids: set[str] = set()
        """Every request starts a trace of its own (the stage breakdown reads them)."""

    def now(self) -> float:
        return self.loop.time() - self.start

    async def send_all(self, requests: Sequence[PlannedRequest]) -> None:
        """Start each request at its time; then wait ``drain_s`` for the last replies."""
        tasks: set[asyncio.Task[None]] = set()
        for request in requests:
            delay = request.at_s - self.now()
            if delay > 0:
                await asyncio.sleep(delay)
            sent_at = self.now()
            self.sent_at.append(sent_at)
            self.open[request.index] = (request, sent_at)
            tasks.add(asyncio.create_task(self._one(request, sent_at)))
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self.config.drain_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        end = self.now()
        for request, sent_at in list(self.open.values()):
            self._record(request, sent_at, end, None, cause="no reply by the end of the drain")

    async def _one(self, request: PlannedRequest, sent_at: float) -> None:
        request_id = f"load-{self.run_id}-{request.index}"
        first: float | None = None
        trace = new_trace()
        self.trace_ids.add(trace.trace_id)
        try:
            async for item in self.clients[request.tenant].stream(
                profiles.prompt_text(request),
                max_tokens=self.config.max_tokens,
                temperature=self.config.temperature,
                request_id=request_id,
                traceparent=trace,
            ):
                if not isinstance(item, InferenceReply):
                    first = self.now() if first is None else first
                    continue
                attempts = attempt_of(request_id, item.request_id)
                self._record(request, sent_at, self.now(), item, first, attempts)
        except TimeoutError:
            self._record(request, sent_at, self.now(), None, cause="timeout")
        except Exception as e:  # a failed send is this request's outcome, not the run's end
            self._record(request, sent_at, self.now(), None, cause=type(e).__name__)

    def _record(
        self,
        request: PlannedRequest,
        sent_at: float,
        done_at: float,
        reply: InferenceReply | None,
        first_chunk_at: float | None = None,
        attempts: int = 1,
        *,
        cause: str = "",
    ) -> None:
        if self.open.pop(request.index, None) is None:
            return
        self.finished.append(
            stats.Outcome(
                index=request.index,
                priority=TIER_PRIORITY[self.tenants[request.tenant].tier],
                sent_at=sent_at,
                done_at=done_at,
                status=None if reply is None else reply.status,
                reason=reply.reason if reply else ReasonCode.NONE,
                first_chunk_at=first_chunk_at,
                completion_tokens=reply.completion_tokens if reply else 0,
                attempts=attempts,
                cause=cause,
            )
        )

    def live(self) -> stats.Live:
        return stats.live(self.sent_at, self.finished, self.now())


async def _refresh(view: Live, render: Callable[[], RenderableType]) -> None:
    while True:
        await asyncio.sleep(REFRESH_S)
        view.update(render(), refresh=True)


async def run(config: LoadConfig, settings: IngressSettings, console: Console) -> dict[str, object]:
    """Run the load; print the live view and the summary on ``console``; return the
    results document."""
    rng = random.Random(config.seed)
    tenants = profiles.spread_tenants(config.tenants, config.tier_mix, config.tenant_prefix)
    segs = profiles.segments(
        config.profile, config.rate, config.duration_s, config.burst_multiplier
    )
    requests = profiles.plan(segs, len(tenants), config.prompts, rng)
    async with open_keystore(settings) as store:
        keys = await tenant_keys(store, tenants)
    retry = RetryPolicy(max_attempts=config.max_attempts)
    clients = [
        SeawallClient(api_key=k.key, kafka=settings.kafka, retry=retry, timeout_s=config.timeout_s)
        for k in keys
    ]
    async with AsyncExitStack() as exits:
        exits.push_async_callback(revoke_keys, settings, keys)
        exits.push_async_callback(lambda: asyncio.gather(*(c.stop() for c in clients)))
        await asyncio.gather(*(c.start() for c in clients))
        load = _Run(config, tenants, clients)
        title = f"seawall load: {config.profile}, {len(requests)} requests planned"

        def render() -> RenderableType:
            return display.live_panel(load.live(), config.duration_s, title)

        with Live(render(), console=console, auto_refresh=False) as view:
            refresher = asyncio.create_task(_refresh(view, render))
            try:
                await load.send_all(requests)
            finally:
                refresher.cancel()
            view.update(render(), refresh=True)
        if not console.is_terminal:
            console.line()  # rich ends the final render with a new line on terminals only
        client_stats = _sum_stats(clients)
    summary = stats.summarize(load.finished, duplicates=client_stats["duplicates"])
    console.print(display.summary_view(summary))
    stages = await stage_breakdown(settings.trace_dir, load.trace_ids)
    if stages:
        console.print("where the time went (per stage, from the services' traces):")
        for line in stage_table(stages):
            console.print(escape(line))
    elif settings.trace_dir is None:
        console.print("no stage breakdown: the stack writes no traces (SEAWALL_TRACE_DIR)")
    doc_config = config.as_json() | {
        "expected_arrivals": profiles.expected_arrivals(segs),
        "tenant_keys": [
            {"name": t.name, "tier": t.tier.value, "key_id": k.record.key_id}
            for t, k in zip(tenants, keys, strict=True)
        ],
    }
    return stats.document(summary, doc_config, client_stats) | {"stages_ms": stages}


async def stage_breakdown(
    trace_dir: str | None, trace_ids: set[str]
) -> dict[str, dict[str, float]]:
    """Per stage, p50/p99 over the run's requests, from the spans the services wrote in
    ``trace_dir`` (empty when they write none there). The services flush their spans
    about once a second: this waits that long first."""
    if trace_dir is None or not trace_ids:
        return {}
    await asyncio.sleep(FLUSH_INTERVAL_S + 0.5)

    def read() -> dict[str, dict[str, float]]:
        directory = Path(trace_dir)
        if not directory.is_dir():
            return {}
        return stage_quantiles(traces_in(directory, trace_ids).values())

    return await asyncio.to_thread(read)


def main(config: LoadConfig, settings: IngressSettings, out: Path | None, console: Console) -> int:
    """The command: run, print, write the results to ``out``; 1 when a server does not
    answer (the run's own figures, lost requests included, do not change the status)."""
    try:
        doc = asyncio.run(run(config, settings, console))
    except KeyboardInterrupt:
        console.print("interrupted: no results")
        return 130
    except (KafkaError, RedisError, ReplyRouterClosed, OSError) as e:
        console.print(
            f"[red]error:[/] a server did not answer ({escape(f'{type(e).__name__}: {e}')})"
        )
        return 1
    if out is not None:
        out.write_text(json.dumps(doc, indent=2) + "\n")
        console.print(f"results written to {out}")
    return 0
