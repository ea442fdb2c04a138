"""Alert notifiers against real servers: an HTTP server for the webhooks (generic JSON
and Slack's shape) and an SMTP server (aiosmtpd) for e-mail; retries, and a notifier
that hangs delays nobody else."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from email import message_from_bytes
from email.message import EmailMessage, Message

import pytest
from aiosmtpd.controller import Controller as SmtpServer
from aiosmtpd.smtp import SMTP as SmtpProtocol
from aiosmtpd.smtp import Envelope, Session
from prometheus_client import REGISTRY, generate_latest
from pydantic import SecretStr

from schemas import Evidence
from services.common.logs import JsonFormatter, LogfmtFormatter
from services.controller.notify import (
    Email,
    NotificationFailed,
    Notifiers,
    SmtpConfig,
    Webhook,
)
from services.controller.policy.alerts import AlertBook, AlertConfig, Condition, Notification
from services.controller.service import notifiers_of
from services.controller.settings import ControllerSettings
from tests.integration.controller.conftest import Hook

pytestmark = pytest.mark.integration


def notification(n: int = 2) -> Notification:
    book = AlertBook(AlertConfig(group_wait_s=0))
    evidence = Evidence(
        reason="error_rate above 0.3", metrics={"error_rate": 0.5}, thresholds={"error_rate": 0.3}
    )
    book.reconcile(
        [
            Condition("breaker_open", f"worker:w{i}", "main", "warning", f"w{i} open", evidence)
            for i in range(n)
        ],
        100.0,
    )
    (note,) = book.due(100.0)
    return note


def count(notifier: str, outcome: str) -> float:
    labels = {"notifier": notifier, "outcome": outcome}
    return REGISTRY.get_sample_value("seawall_alert_notifications_total", labels) or 0.0


async def test_the_json_webhook_gets_the_alert_records(hook: Hook) -> None:
    notifiers = Notifiers([Webhook(hook.url, "json", timeout_s=2.0)])
    notifiers.start()
    try:
        notifiers.submit([notification()])
        await asyncio.wait_for(hook.arrived.wait(), 10)
    finally:
        await notifiers.stop()
    (body,) = hook.bodies
    assert (body["rule"], body["pool"], body["status"], body["severity"]) == (
        "breaker_open",
        "main",
        "firing",
        "warning",
    )
    alerts = body["alerts"]
    assert isinstance(alerts, list)
    assert [a["scope"] for a in alerts] == ["worker:w0", "worker:w1"]
    assert alerts[0]["evidence"]["metrics"] == {"error_rate": 0.5}


async def test_the_slack_webhook_gets_one_text_and_failures_are_retried(hook: Hook) -> None:
    hook.fail_first = 2
    before = (count("webhook-slack", "retried"), count("webhook-slack", "sent"))
    notifiers = Notifiers([Webhook(hook.url, "slack", timeout_s=2.0)], retry_base_s=0.01)
    notifiers.start()
    try:
        notifiers.submit([notification(25)])
        await asyncio.wait_for(hook.arrived.wait(), 10)
        for _ in range(500):  # the server answered; the notifier counts it on the reply
            if count("webhook-slack", "sent") > before[1]:
                break
            await asyncio.sleep(0.01)
    finally:
        await notifiers.stop()
    (body,) = hook.bodies
    text = body["text"]
    assert isinstance(text, str)
    lines = text.splitlines()
    assert lines[0] == "[seawall] FIRING warning: breaker_open in pool main (25 scopes)"
    assert lines[1] == "- w0 open (seen 1x)"
    assert lines[-1] == "- and 5 more"
    after = (count("webhook-slack", "retried"), count("webhook-slack", "sent"))
    assert (after[0] - before[0], after[1] - before[1]) == (2, 1)


class _Inbox:
    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.arrived = asyncio.Event()
        self.loop = asyncio.get_running_loop()

    async def handle_DATA(self, server: SmtpProtocol, session: Session, envelope: Envelope) -> str:
        assert isinstance(envelope.content, bytes)
        self.messages.append(message_from_bytes(envelope.content))
        self.loop.call_soon_threadsafe(self.arrived.set)
        return "250 OK"


async def test_email_goes_out_while_a_hanging_webhook_waits(hook: Hook) -> None:
    hook.hang = True  # until the test ends: it must not hold the e-mail back
    inbox = _Inbox()
    with socket.socket() as probe:  # aiosmtpd connects to its own port to check it is up
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = SmtpServer(inbox, hostname="127.0.0.1", port=port)
    server.start()
    try:
        smtp = SmtpConfig("127.0.0.1", port, "seawall@example.org", ("ops@example.org",))
        notifiers = Notifiers(
            [Webhook(hook.url, "json", timeout_s=60.0), Email(smtp)], retry_base_s=0.01
        )
        notifiers.start()
        try:
            loop = asyncio.get_running_loop()
            started = loop.time()
            notifiers.submit([notification()])
            assert loop.time() - started < 0.05  # submit never waits on a notifier
            await asyncio.wait_for(inbox.arrived.wait(), 10)
        finally:
            await notifiers.stop()
    finally:
        server.stop()
    (mail,) = inbox.messages
    assert mail["Subject"] == "[seawall] FIRING warning: breaker_open in pool main (2 scopes)"
    assert mail["To"] == "ops@example.org"
    body = mail.get_payload()
    assert isinstance(body, str)
    assert "worker:w0: error_rate above 0.3" in body
    assert "error_rate = 0.5 (limit 0.3)" in body
    assert hook.bodies == []


def test_the_json_body_is_plain_json() -> None:
    from services.controller.notify import as_json

    assert json.loads(json.dumps(as_json(notification(1))))["alerts"][0]["count"] == 1


async def test_a_stop_that_arrives_as_an_email_is_handed_over_still_stops_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The race CI hit: the SMTP thread finishes in the same loop turn as the cancel.
    Before Python 3.12 ``asyncio.wait_for`` returned the thread's result there and
    swallowed the cancel, so the channel went back to its queue and stop() hung."""
    handed_over: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    monkeypatch.setattr(asyncio, "to_thread", lambda *_: handed_over)
    email = Email(SmtpConfig("127.0.0.1", 25, "seawall@example.org", ("ops@example.org",)))
    sending = asyncio.create_task(email.send(notification()))
    await asyncio.sleep(0)  # sending now waits on the thread
    handed_over.set_result(None)
    sending.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(sending, 5)


def test_smtp_credentials_are_never_sent_without_tls() -> None:
    with pytest.raises(ValueError, match="STARTTLS"):
        SmtpConfig("mail", 587, "a@b.c", ("d@e.f",), user="seawall", password="secret")
    SmtpConfig("mail", 587, "a@b.c", ("d@e.f",), starttls=True, user="seawall", password="s")


def test_starttls_verifies_the_servers_certificate(monkeypatch: pytest.MonkeyPatch) -> None:
    """smtplib's ``starttls()`` with no context checks no certificate: the login after it
    would go to whoever answered. The e-mail channel hands it a verifying one."""
    import smtplib
    import ssl

    calls: list[tuple[str, object]] = []

    class FakeSmtp:
        def __init__(self, host: str, port: int, timeout: float) -> None:
            calls.append(("connect", (host, port)))

        def __enter__(self) -> FakeSmtp:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def starttls(self, context: ssl.SSLContext | None = None) -> None:
            calls.append(("starttls", context))

        def login(self, user: str, password: str) -> None:
            calls.append(("login", user))

        def send_message(self, message: object) -> None:
            calls.append(("send", None))

    monkeypatch.setattr(smtplib, "SMTP", FakeSmtp)
    config = SmtpConfig(
        "mail", 587, "a@b.c", ("d@e.f",), starttls=True, user="seawall", password="s"
    )
    Email(config)._deliver(EmailMessage())
    assert [name for name, _ in calls] == ["connect", "starttls", "login", "send"]
    context = calls[1][1]
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode is ssl.CERT_REQUIRED
    assert context.check_hostname


# -- secrets (security issue 40, item 6) -------------------------------------------------
WEBHOOK_TOKEN = "XyZwebhookT0ken9f8e7d6c"
WEBHOOK_SIG = "sigQQ3141592653589"
SMTP_PASSWORD = "smtp-Pa55word-k7Jq"
SECRETS = (WEBHOOK_TOKEN, WEBHOOK_SIG, SMTP_PASSWORD)


def refused_port() -> int:
    """A port of 127.0.0.1 that nothing listens on: a connection to it is refused."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def everything_logged(records: list[logging.LogRecord]) -> str:
    """Every record as the services print it, extra fields and tracebacks included, in
    both formats; and its raw message and arguments."""
    logfmt, js = LogfmtFormatter(), JsonFormatter()
    return "\n".join(f"{logfmt.format(r)}\n{js.format(r)}\n{r.msg!r} {r.args!r}" for r in records)


async def given_up(notifier: str, before: float) -> None:
    for _ in range(1000):
        if count(notifier, "failed") > before:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{notifier}: the notification was not given up")


async def test_webhook_url_and_smtp_password_never_reach_logs_reprs_or_metrics(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Both notifiers fail on a refused connection, retried then given up: the logs,
    at every level, name the webhook's host only; no repr, log or metric holds a secret."""
    caplog.set_level(logging.DEBUG)
    hook_port, smtp_port = refused_port(), refused_port()
    settings = ControllerSettings(
        alert_webhook_url=f"http://127.0.0.1:{hook_port}/services/T0/B0/{WEBHOOK_TOKEN}"
        f"?sig={WEBHOOK_SIG}",
        alert_smtp_host="127.0.0.1",
        alert_smtp_port=smtp_port,
        alert_smtp_starttls=True,
        alert_smtp_user="seawall",
        alert_smtp_password=SMTP_PASSWORD,
        alert_email_to="ops@example.org",
        alert_notify_timeout_s=2.0,
        alert_notify_attempts=2,
        alert_notify_retry_s=0.01,
    )
    before = count("webhook-json", "failed"), count("email", "failed")
    notifiers = notifiers_of(settings)
    notifiers.start()
    try:
        notifiers.submit([notification()])
        await given_up("webhook-json", before[0])
        await given_up("email", before[1])
    finally:
        await notifiers.stop()

    logged = everything_logged(caplog.records)
    shown = [repr(settings), str(settings), settings.model_dump_json(), repr(notifiers._channels)]
    shown += [repr(c.sender) for c in notifiers._channels]
    metrics = generate_latest(REGISTRY).decode()
    for secret in SECRETS:
        assert secret not in logged
        assert not any(secret in text for text in shown)
        assert secret not in metrics
    gave_up = [r for r in caplog.records if r.getMessage() == "an alert notification was given up"]
    assert {getattr(r, "target", None) for r in gave_up} == {
        f"http://127.0.0.1:{hook_port}",
        f"smtp://127.0.0.1:{smtp_port}",
    }


async def test_a_webhook_answering_an_error_is_logged_by_host_only(
    hook: Hook, caplog: pytest.LogCaptureFixture
) -> None:
    """The server answers (404: no such path): httpx logs the request at INFO with its
    URL, and ``raise_for_status`` would have put it in the error."""
    caplog.set_level(logging.DEBUG)
    base = hook.url.removesuffix("/hook")
    webhook = Webhook(
        SecretStr(f"{base}/services/T0/B0/{WEBHOOK_TOKEN}?sig={WEBHOOK_SIG}"), "slack", 2.0
    )
    try:
        with pytest.raises(NotificationFailed) as failed:
            await webhook.send(notification())
    finally:
        await webhook.aclose()
    assert str(failed.value) == f"{base}: HTTP 404"
    # The receiving server runs in this process too; its access log is not seawall's.
    ours = [r for r in caplog.records if not r.name.startswith("aiohttp")]
    assert [r for r in ours if r.name == "httpx"]  # httpx did log the request ...
    logged = everything_logged(ours)
    assert base in logged
    for secret in (WEBHOOK_TOKEN, WEBHOOK_SIG):  # ... by its host only
        assert secret not in logged
        assert secret not in repr(failed.value.__cause__) + repr(failed.value.__context__)


def test_a_failed_smtp_login_logs_no_password(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The password reaches the server's login, and nothing else."""
    import smtplib

    caplog.set_level(logging.DEBUG)
    logins: list[tuple[str, str]] = []

    class RefusingSmtp:
        def __init__(self, host: str, port: int, timeout: float) -> None:
            pass

        def __enter__(self) -> RefusingSmtp:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def starttls(self, context: object = None) -> None:
            pass

        def login(self, user: str, password: str) -> None:
            logins.append((user, password))
            raise smtplib.SMTPAuthenticationError(535, b"5.7.8 credentials invalid")

    monkeypatch.setattr(smtplib, "SMTP", RefusingSmtp)
    config = SmtpConfig(
        "mail", 587, "a@b.c", ("d@e.f",), starttls=True, user="seawall", password=SMTP_PASSWORD
    )
    with pytest.raises(smtplib.SMTPAuthenticationError) as refused:
        Email(config)._deliver(EmailMessage())
    assert logins == [("seawall", SMTP_PASSWORD)]
    assert SMTP_PASSWORD not in repr(config) + str(refused.value)
    assert SMTP_PASSWORD not in everything_logged(caplog.records)
