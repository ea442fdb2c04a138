"""Body size, User-Agent blacklist and prompt-length pre-filters."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, Histogram

from services.common.tokenizer import count_tokens as workers_count_tokens
from services.ingress.policy.filters import FilterVerdict
from services.ingress.policy.filters.body import (
    DEFAULT_MAX_BODY_BYTES,
    check_body,
    check_declared_length,
)
from services.ingress.policy.filters.prompt_length import (
    LONG_PROMPT_TOKENS,
    PROMPT_TOKEN_BUCKETS,
    count_tokens,
    is_long,
    long_prompt_share_promql,
)
from services.ingress.policy.filters.useragent import UserAgentBlacklist

pytestmark = pytest.mark.unit


def test_body_limit_is_16_kib_and_inclusive() -> None:
    assert DEFAULT_MAX_BODY_BYTES == 16384
    assert check_body(b"x" * 16384).allowed
    assert check_body(b"x" * 16385) == FilterVerdict(False, "body_too_large")
    assert check_body(bytearray(11), limit=10).reason == "body_too_large"


@pytest.mark.parametrize(
    ("header", "reason"),
    [
        (None, None),
        ("16384", None),
        (" 0 ", None),
        ("16385", "body_too_large"),
        ("0016384", None),
        ("9" * 10_000, "body_too_large"),
        ("-1", "bad_content_length"),
        ("12abc", "bad_content_length"),
        ("١٢", "bad_content_length"),  # Arabic-Indic digits: isdigit() but not ASCII
        ("", "bad_content_length"),
    ],
)
def test_declared_length(header: str | None, reason: str | None) -> None:
    verdict = check_declared_length(header)
    assert verdict.reason == reason
    assert verdict.allowed == (reason is None)


def test_user_agent_substrings_are_case_insensitive() -> None:
    bl = UserAgentBlacklist.from_config(["BadBot", "sqlmap"])
    assert bl.check("Mozilla/5.0 (compatible; badbot/2.1)").reason == "user_agent_blocked"
    assert not bl.check("SQLMap/1.7").allowed
    assert bl.check("Mozilla/5.0 (X11; Linux x86_64) Firefox/126.0").allowed


def test_user_agent_regexes_are_case_insensitive() -> None:
    bl = UserAgentBlacklist.from_config([], [r"^curl/", r"python-requests/\d"])
    assert not bl.check("CURL/8.5.0").allowed
    assert bl.check("not curl/8.5.0").allowed
    assert not bl.check("Python-Requests/2.31").allowed


def test_missing_user_agent_is_configurable() -> None:
    assert UserAgentBlacklist.from_config().check(None).allowed
    strict = UserAgentBlacklist.from_config(block_missing=True)
    assert strict.check(None).reason == "user_agent_missing"
    assert strict.check("").reason == "user_agent_missing"


def test_default_blacklist_and_bad_regex() -> None:
    assert not UserAgentBlacklist.from_config().check("masscan/1.3").allowed
    with pytest.raises(re.error):
        UserAgentBlacklist.from_config([], ["(unclosed"])


@pytest.mark.parametrize(
    ("text", "tokens"),
    [("", 0), ("hello world", 2), ("internationalization", 5), ("你好，世界", 5)],
)
def test_prompts_are_counted_with_the_fleet_tokenizer(text: str, tokens: int) -> None:
    assert count_tokens is workers_count_tokens
    assert count_tokens(text) == tokens


def test_buckets_include_the_long_prompt_threshold() -> None:
    assert list(PROMPT_TOKEN_BUCKETS) == sorted(set(PROMPT_TOKEN_BUCKETS))
    assert LONG_PROMPT_TOKENS in PROMPT_TOKEN_BUCKETS
    assert is_long(4097)
    assert not is_long(4096)


def test_promql_names_the_bucket_prometheus_client_exports() -> None:
    registry = CollectorRegistry()
    hist = Histogram("seawall_prompt_tokens", "t", buckets=PROMPT_TOKEN_BUCKETS, registry=registry)
    hist.observe(5000)
    hist.observe(10)
    les = {
        s.labels["le"] for m in registry.collect() for s in m.samples if s.name.endswith("_bucket")
    }
    expr = long_prompt_share_promql("seawall_prompt_tokens", "10m")
    le = re.search(r'le="([^"]+)"', expr)
    assert le is not None
    assert le.group(1) in les
    assert "seawall_prompt_tokens_count[10m]" in expr
