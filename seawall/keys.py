"""``seawall keys``: create, list, revoke and rotate API keys.

Mounted by ``seawall/cli.py`` (``app.add_typer(keys_app, name="keys")``). Reads the
same settings as ingress (``SEAWALL_REDIS_URL``, ``SEAWALL_REDIS_PREFIX``,
``SEAWALL_KEY_PEPPER``, ``SEAWALL_KAFKA_BOOTSTRAP``, ``SEAWALL_TOPIC_PREFIX``): the
pepper must be ingress's, or its keys will not verify. Every change is audited on
``llm.audit``, so the broker must answer too (nothing is changed when it does not).

A new key is printed once — on standard output, alone on its line, or with ``--json``
as a JSON object — and never again: only its hash is stored.

Key records and tenant policies carry a MAC under the pepper (``keystore``); ingress
refuses those without one. ``seawall keys sign`` signs the records an older version
wrote, once, when upgrading (see ``sign``).
"""

from __future__ import annotations

import asyncio
import getpass
import json
import sys
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, TypeVar

import typer
from aiokafka.errors import KafkaError
from pydantic import TypeAdapter, ValidationError
from redis.exceptions import RedisError
from rich.console import Console
from rich.table import Table

from schemas import Tier
from schemas.base import Ident
from seawall_client.kafka import ensure_topics
from seawall_client.topics import RedisKeys
from services.common.bus import make_producer, topics_of
from services.common.redisclient import make_redis
from services.ingress.keystore import (
    AuditLog,
    KeyNotFound,
    KeyRecordRefused,
    KeyStore,
    SignReport,
    TenantPolicy,
    check_region,
)
from services.ingress.policy.keys import IssuedKey, KeyRecord, disabled_at, phase
from services.ingress.settings import IngressSettings, safe_name

T = TypeVar("T")

keys_app = typer.Typer(
    no_args_is_help=True,
    help="Manage API keys: stored hashed in Redis, every change audited on llm.audit.",
)


class Sensitive(StrEnum):
    """A tenant's policy for sensitive data in prompts."""

    BLOCK = "block"
    REDACT = "redact"


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%MZ")


def _actor() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no user name in this environment
        user = "unknown"
    return f"cli:{safe_name(user)}"


@asynccontextmanager
async def open_keystore(settings: IngressSettings) -> AsyncIterator[KeyStore]:
    topics = topics_of(settings)
    audit_spec = next(spec for spec in topics.specs() if spec.name == topics.audit)
    await ensure_topics(settings.kafka, [audit_spec])
    producer = make_producer(settings)
    await producer.start()
    redis = make_redis(settings)
    try:
        yield KeyStore(
            redis,
            RedisKeys(settings.redis_prefix),
            settings.pepper,
            AuditLog(producer, topics.audit, _actor()),
            default_sensitive=settings.default_sensitive_policy,
        )
    finally:
        await producer.stop()
        await redis.aclose()


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """Run one command; unreachable servers and refusals end it with a message."""
    try:
        return asyncio.run(coro)
    except (KafkaError, RedisError, OSError) as e:
        typer.echo(f"error: a server did not answer ({type(e).__name__}: {e})", err=True)
        raise typer.Exit(1) from None
    except KeyRecordRefused as e:
        typer.echo(
            f"error: the record of key {e.args[0]!r} fails its integrity check (no MAC: "
            "written by an older version, run `seawall keys sign`; a wrong MAC: altered "
            "in Redis, or written under another pepper)",
            err=True,
        )
        raise typer.Exit(1) from None
    except KeyNotFound as e:
        typer.echo(f"error: no key {e.args[0]!r}", err=True)
        raise typer.Exit(1) from None
    except PermissionError as e:
        typer.echo(f"error: the key may not do that ({e.args[0]})", err=True)
        raise typer.Exit(1) from None
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


def _settings() -> IngressSettings:
    try:
        settings = IngressSettings()
    except ValidationError as e:
        for error in e.errors(include_url=False, include_input=False):
            typer.echo(f"error: {error['msg']}", err=True)
        raise typer.Exit(2) from None
    if settings.dev_pepper:
        typer.echo("warning: SEAWALL_DEV_MODE: using the development pepper", err=True)
    return settings


def _issued(issued: IssuedKey, policy: TenantPolicy) -> dict[str, Any]:
    record = issued.record
    return {
        "key": issued.key,
        "key_id": record.key_id,
        "tenant": record.tenant,
        "tier": policy.tier.value,
        "sensitive": policy.sensitive,
        "region": policy.region,
        "created_at": record.created_at,
        "disabled_at": disabled_at(record),
    }


def _print_new_key(doc: dict[str, Any], as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(doc))
        return
    region = f", region {doc['region']}" if doc.get("region") else ""
    typer.echo(
        f"key {doc['key_id']} for tenant {doc['tenant']} (tier {doc['tier']}, "
        f"sensitive data: {doc['sensitive']}{region}); store it now, it is shown only "
        "this once:",
        err=True,
    )
    typer.echo(doc["key"])


@keys_app.command("create")
def create(
    tenant: Annotated[str, typer.Option(help="The tenant the key belongs to.")],
    tier: Annotated[
        Tier | None, typer.Option(help="The tenant's tier (required for a new tenant).")
    ] = None,
    sensitive: Annotated[
        Sensitive | None,
        typer.Option(help="The tenant's policy for sensitive data in prompts."),
    ] = None,
    region: Annotated[
        str | None,
        typer.Option(
            help="The tenant's region: where its Kafka requests come from, for regional "
            "throttles and hotspots (a record's client_ip is never believed). '' clears "
            "it. HTTP requests keep their client address's region."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON, for scripts.")] = False,
) -> None:
    """Create a key; print it once. ``--tier``, ``--sensitive`` and ``--region`` set the
    tenant's policy (for all its keys) on the way."""
    try:
        TypeAdapter(Ident).validate_python(tenant)
    except ValidationError:
        raise typer.BadParameter("letters, digits and ._:@/- only", param_hint="--tenant") from None
    if region:
        try:
            check_region(region)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--region") from None
    settings = _settings()

    async def go() -> tuple[IssuedKey, TenantPolicy]:
        async with open_keystore(settings) as store:
            return await store.create(
                tenant,
                tier=tier,
                sensitive=sensitive.value if sensitive else None,
                region=region,
            )

    issued, policy = _run(go())
    _print_new_key(_issued(issued, policy), as_json)


@keys_app.command("list")
def list_keys(
    tenant: Annotated[str | None, typer.Option(help="Only this tenant's keys.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON, for scripts.")] = False,
) -> None:
    """List keys (never the keys themselves) with their lifecycle phase."""
    settings = _settings()

    async def go() -> list[tuple[KeyRecord, TenantPolicy | None]]:
        async with open_keystore(settings) as store:
            return [(k.record, k.policy) for k in await store.list_keys(tenant)]

    now = datetime.now(UTC).timestamp()
    listing = _run(go())
    if as_json:
        rows = [
            {
                "key_id": record.key_id,
                "tenant": record.tenant,
                "tier": policy.tier.value if policy else None,
                "region": policy.region if policy else None,
                "phase": phase(record, now),
                "created_at": record.created_at,
                "rotated_at": record.rotated_at,
                "revoked_at": record.revoked_at,
                "disabled_at": disabled_at(record),
            }
            for record, policy in listing
        ]
        typer.echo(json.dumps(rows))
        return
    table = Table("key id", "tenant", "tier", "phase", "created", "disabled at")
    for record, policy in listing:
        table.add_row(
            record.key_id,
            record.tenant,
            policy.tier.value if policy else "-",
            phase(record, now),
            _when(record.created_at),
            _when(disabled_at(record)),
        )
    Console(file=sys.stdout).print(table)


@keys_app.command("revoke")
def revoke(key_id: Annotated[str, typer.Argument(help="The key id (not the key).")]) -> None:
    """Disable a key now."""
    settings = _settings()

    async def go() -> KeyRecord:
        async with open_keystore(settings) as store:
            return await store.revoke(key_id)

    record = _run(go())
    typer.echo(f"revoked key {record.key_id} of tenant {record.tenant}")


@keys_app.command("rotate")
def rotate(
    key_id: Annotated[str, typer.Argument(help="The key id (not the key) to replace.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON, for scripts.")] = False,
) -> None:
    """Replace an active key: print the new key once; the old one enters its grace
    period (it still works, with a deprecation warning, until it is disabled)."""
    settings = _settings()

    async def go() -> tuple[KeyRecord, IssuedKey, TenantPolicy | None]:
        async with open_keystore(settings) as store:
            old, issued = await store.rotate(key_id)
            return old, issued, await store.policy(old.tenant)

    old, issued, policy = _run(go())
    assert policy is not None, "a tenant with keys has a policy"
    doc = _issued(issued, policy) | {
        "replaces": old.key_id,
        "replaced_disabled_at": disabled_at(old),
    }
    if not as_json:
        typer.echo(f"key {old.key_id} stops working at {_when(disabled_at(old))}", err=True)
    _print_new_key(doc, as_json)


@keys_app.command("sign")
def sign(
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Only list what would be signed.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON, for scripts.")] = False,
) -> None:
    """Sign the key records and tenant policies an older version wrote (once, when
    upgrading): ingress refuses records without a MAC.

    Only records with no MAC at all are signed, each only if unchanged since it was
    read, each audited (``record_signed``). What a record holds when signed is trusted
    from then on: review the list (``--dry-run`` first) against what you issued. Records
    whose MAC is wrong were altered (or written under another pepper) and are never
    signed: revoke such a key, or give such a tenant its tier again with ``create``.
    Exits 1 when any record is left refused."""
    settings = _settings()

    async def go() -> SignReport:
        async with open_keystore(settings) as store:
            return await store.sign_unsigned(dry_run=dry_run)

    report = _run(go())
    left = report.altered + report.damaged + report.changed
    if as_json:
        doc = {
            "dry_run": dry_run,
            "keys": [
                {"key_id": r.key_id, "tenant": r.tenant, "revoked_at": r.revoked_at}
                for r in report.keys
            ],
            "policies": [
                # a region only where the record holds one: whatever it holds is signed,
                # so the operator must see it
                {"tenant": t, "tier": p.tier.value, "sensitive": p.sensitive}
                | ({"region": p.region} if p.region is not None else {})
                for t, p in report.policies
            ],
            "altered": [{"record": kind, "name": name} for kind, name in report.altered],
            "damaged": [{"record": kind, "name": name} for kind, name in report.damaged],
            "changed": [{"record": kind, "name": name} for kind, name in report.changed],
        }
        typer.echo(json.dumps(doc))
    else:
        verb = "would sign" if dry_run else "signed"
        for tenant, policy in report.policies:
            region = f", region {policy.region}" if policy.region is not None else ""
            typer.echo(
                f"{verb} policy of tenant {tenant}: tier {policy.tier.value}, "
                f"sensitive data: {policy.sensitive}{region}"
            )
        for r in report.keys:
            revoked = f", revoked {_when(r.revoked_at)}" if r.revoked_at is not None else ""
            typer.echo(
                f"{verb} key {r.key_id} of tenant {r.tenant} "
                f"(created {_when(r.created_at)}{revoked})"
            )
        for kind, name in report.altered:
            typer.echo(f"refused, wrong MAC (altered?): {kind} {name}", err=True)
        for kind, name in report.damaged:
            typer.echo(f"refused, damaged: {kind} {name}", err=True)
        for kind, name in report.changed:
            typer.echo(f"not signed, changed while read (run again): {kind} {name}", err=True)
        typer.echo(
            f"{len(report.keys)} key records and {len(report.policies)} policies {verb}; "
            f"{len(left)} left refused",
            err=True,
        )
    if left:
        raise typer.Exit(1)
