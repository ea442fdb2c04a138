"""Alert notifications: a webhook (generic JSON or Slack-compatible) and e-mail (SMTP).

The controller hands each grouped ``Notification`` (``policy.alerts``) to ``Notifiers.
submit``, which never waits: every notifier has its own bounded queue and task, so a
webhook that hangs or an SMTP server that is down delays nothing but its own messages.
A full queue drops the newest (counted and logged; the alert records on ``llm.alerts``
stay the truth). Each message is tried up to ``attempts`` times, each attempt bounded by
``timeout_s``, with exponential backoff between them (full jitter, from ``retry_base_s``
doubling to at most 60 s); then it is given up (counted and logged).

Secrets: the webhook's URL (Slack's and most others carry their token in the path or
the query) and the SMTP password are ``SecretStr``s from the settings to the one call
that uses them, so no repr, log line, traceback or metric holds them. Logs name a
webhook by its scheme, host and port only (``Webhook.target``) and a failure by its
exception's type; a failed webhook raises ``NotificationFailed``, which carries neither
the URL nor httpx's message (``raise_for_status`` puts the URL in it); and httpx's own
request log line (INFO, with the full URL) shows the target instead (``_HideUrls``).

Formats:

- ``json``: ``{"version": 1, "rule", "pool", "status", "severity", "at", "alerts": [...]}``
  with every alert record as on the topic;
- ``slack``: ``{"text": ...}`` (Slack's incoming-webhook shape, which Mattermost and
  Rocket.Chat accept too): a headline and one line per alert;
- e-mail: the headline as the subject, the lines and each alert's evidence as a plain
  text body.
"""

from __future__ import annotations

import asyncio
import json
import logging
import smtplib
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from email.message import EmailMessage
from typing import Literal, Protocol

import httpx
from prometheus_client import Counter
from pydantic import SecretStr

from services.common.failures import Backoff
from services.common.lifecycle import cancel_tasks
from services.controller.policy.alerts import Notification

log = logging.getLogger(__name__)

NOTIFICATIONS = Counter(
    "seawall_alert_notifications_total",
    "Alert notifications, by notifier and outcome (sent, retried, failed, dropped)",
    ["notifier", "outcome"],
)
MAX_LINES = 20
"""Alerts listed in one message; the rest are counted ("and 12 more")."""


def headline(note: Notification) -> str:
    where = f" in pool {note.pool}" if note.pool else ""
    n = len(note.alerts)
    scopes = f"{n} scopes" if n > 1 else note.alerts[0].scope
    return f"[seawall] {note.status.upper()} {note.severity}: {note.rule}{where} ({scopes})"


def lines(note: Notification) -> list[str]:
    shown = [f"- {a.summary} (seen {a.count}x)" for a in note.alerts[:MAX_LINES]]
    if len(note.alerts) > MAX_LINES:
        shown.append(f"- and {len(note.alerts) - MAX_LINES} more")
    return shown


def as_json(note: Notification) -> dict[str, object]:
    return {
        "version": 1,
        "rule": note.rule,
        "pool": note.pool,
        "status": note.status,
        "severity": note.severity,
        "at": note.at,
        "alerts": [a.model_dump(mode="json") for a in note.alerts],
    }


def as_slack(note: Notification) -> dict[str, object]:
    return {"text": "\n".join([headline(note), *lines(note)])}


def as_email(note: Notification, sender: str, recipients: Sequence[str]) -> EmailMessage:
    message = EmailMessage()
    message["Subject"] = headline(note)
    message["From"] = sender
    message["To"] = ", ".join(recipients)
    body = [*lines(note), ""]
    for a in note.alerts[:MAX_LINES]:
        evidence = a.evidence
        body.append(f"{a.scope}: {evidence.reason}")
        for name, value in evidence.metrics.items():
            limit = evidence.thresholds.get(name)
            body.append(f"  {name} = {value:g}" + ("" if limit is None else f" (limit {limit:g})"))
    message.set_content("\n".join(body))
    return message


class Sender(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def target(self) -> str:
        """Where it sends, fit for a log line: no path, query or credentials."""
        ...

    async def send(self, note: Notification) -> None: ...

    async def aclose(self) -> None: ...


class NotificationFailed(RuntimeError):
    """A webhook call failed; the message names the target and the failure's kind only."""


def webhook_target(url: str) -> str:
    """``scheme://host[:port]`` of ``url``: what may be logged of a webhook."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError):
        return "<invalid url>"
    port = f":{parsed.port}" if parsed.port is not None else ""
    return f"{parsed.scheme}://{parsed.host}{port}"


def _normalised(url: str) -> str:
    try:
        return str(httpx.URL(url))
    except (httpx.InvalidURL, TypeError, ValueError):
        return url


class _HideUrls(logging.Filter):
    """On httpx's logger: each webhook URL in a record is replaced by its target.
    httpx logs every request it sends, at INFO, with the full URL."""

    def __init__(self) -> None:
        super().__init__()
        self.secrets: dict[str, str] = {}
        """URL → what is shown instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.secrets:
            return True
        record.msg = self._hide(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(self._hide(a) for a in record.args)
        elif record.args:
            record.args = {k: self._hide(v) for k, v in record.args.items()}
        return True

    def _hide(self, value: object) -> object:
        """``value`` as it is, unless its text holds a secret (a ``%d`` argument must
        stay a number): then that text with the secret replaced."""
        text = str(value)
        hidden = text
        for secret, shown in self.secrets.items():
            hidden = hidden.replace(secret, shown)
        return value if hidden == text else hidden


_HIDE_URLS = _HideUrls()
logging.getLogger("httpx").addFilter(_HIDE_URLS)


class Webhook:
    def __init__(
        self, url: SecretStr | str, style: Literal["json", "slack"], timeout_s: float
    ) -> None:
        self.name = f"webhook-{style}"
        self._url = url if isinstance(url, SecretStr) else SecretStr(url)
        raw = self._url.get_secret_value()
        self.target = webhook_target(raw)
        for form in {raw, _normalised(raw)}:  # as configured, and as httpx prints it
            _HIDE_URLS.secrets[form] = self.target
        self._style = style
        self._client = httpx.AsyncClient(timeout=timeout_s)

    def __repr__(self) -> str:
        return f"Webhook({self.target!r}, {self._style!r})"

    async def send(self, note: Notification) -> None:
        body = as_slack(note) if self._style == "slack" else as_json(note)
        try:
            response = await self._client.post(
                self._url.get_secret_value(),
                content=json.dumps(body),
                headers={"content-type": "application/json"},
            )
        except httpx.HTTPError as e:  # its message and its request hold the URL
            raise NotificationFailed(f"{self.target}: {type(e).__name__}") from None
        if not response.is_success:
            raise NotificationFailed(f"{self.target}: HTTP {response.status_code}")

    async def aclose(self) -> None:
        await self._client.aclose()


@dataclass(frozen=True)
class SmtpConfig:
    host: str
    port: int
    sender: str
    recipients: tuple[str, ...]
    starttls: bool = False
    user: str | None = None
    password: SecretStr | str | None = None
    """Kept as a ``SecretStr`` (a plain string given is wrapped): revealed only to
    ``smtplib``'s login."""
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.user is not None and not self.starttls:
            raise ValueError("SMTP credentials are sent only over STARTTLS: set starttls")
        if isinstance(self.password, str):
            object.__setattr__(self, "password", SecretStr(self.password))


class Email:
    name = "email"

    def __init__(self, config: SmtpConfig) -> None:
        self._config = config
        self.target = f"smtp://{config.host}:{config.port}"

    async def send(self, note: Notification) -> None:
        message = as_email(note, self._config.sender, self._config.recipients)
        # asyncio.timeout, not wait_for: before Python 3.12 wait_for swallows a
        # cancellation that arrives as the thread finishes, and the channel's task then
        # waits on its queue forever instead of stopping (seen in CI: stop() hung).
        async with asyncio.timeout(self._config.timeout_s + 1.0):
            await asyncio.to_thread(self._deliver, message)

    def _deliver(self, message: EmailMessage) -> None:
        c = self._config
        with smtplib.SMTP(c.host, c.port, timeout=c.timeout_s) as smtp:
            if c.starttls:
                # A verifying context: smtplib's default checks no certificate, and the
                # login that follows would go to whoever answered.
                smtp.starttls(context=ssl.create_default_context())
            if c.user is not None and c.password is not None:
                password = c.password
                smtp.login(
                    c.user,
                    password.get_secret_value() if isinstance(password, SecretStr) else password,
                )
            smtp.send_message(message)

    async def aclose(self) -> None:
        return None


class _Channel:
    """One notifier's queue and task."""

    def __init__(self, sender: Sender, size: int, attempts: int, retry_base_s: float) -> None:
        self.sender = sender
        self.queue: asyncio.Queue[Notification] = asyncio.Queue(size)
        self.attempts = attempts
        self.retry_base_s = retry_base_s

    async def run(self) -> None:
        while True:
            note = await self.queue.get()
            await self._deliver(note)

    async def _deliver(self, note: Notification) -> None:
        name = self.sender.name
        backoff = Backoff(base_s=self.retry_base_s, cap_s=max(60.0, self.retry_base_s))
        for attempt in range(1, self.attempts + 1):
            try:
                await self.sender.send(note)
            except Exception as e:  # any failure of this message: retry, then give up
                if attempt == self.attempts:
                    NOTIFICATIONS.labels(name, "failed").inc()
                    log.error(
                        "an alert notification was given up",
                        extra={
                            "notifier": name,
                            "target": self.sender.target,
                            "rule": note.rule,
                            "error": type(e).__name__,
                        },
                    )
                    return
                NOTIFICATIONS.labels(name, "retried").inc()
                await backoff.wait()
                continue
            NOTIFICATIONS.labels(name, "sent").inc()
            return


class Notifiers:
    """The notifiers configured; ``submit`` never blocks."""

    def __init__(
        self,
        senders: Sequence[Sender],
        *,
        queue_size: int = 1000,
        attempts: int = 5,
        retry_base_s: float = 1.0,
    ) -> None:
        self._channels = [_Channel(s, queue_size, attempts, retry_base_s) for s in senders]
        self._tasks: set[asyncio.Task[None]] = set()

    def __bool__(self) -> bool:
        return bool(self._channels)

    def start(self) -> None:
        self._tasks = {asyncio.create_task(c.run()) for c in self._channels}

    def submit(self, notes: Sequence[Notification]) -> None:
        for note in notes:
            for channel in self._channels:
                try:
                    channel.queue.put_nowait(note)
                except asyncio.QueueFull:
                    NOTIFICATIONS.labels(channel.sender.name, "dropped").inc()
                    log.warning(
                        "an alert notification was dropped: its notifier is behind",
                        extra={"notifier": channel.sender.name, "rule": note.rule},
                    )

    async def stop(self) -> None:
        """Stop sending (what is queued is dropped: the records on ``llm.alerts`` stay)."""
        await cancel_tasks(self._tasks)
        self._tasks = set()
        for channel in self._channels:
            await channel.sender.aclose()
