"""Every Redis error is either "the store cannot serve now" (retry, or the caller's
fallback) or "this call is wrong" (the request's own error): ``redis_unavailable``."""

from __future__ import annotations

import pytest
import redis.exceptions as rx

from services.common.failures import StoreUnavailable, is_infrastructure, redis_unavailable

UNAVAILABLE = [
    rx.ConnectionError("refused"),
    rx.BusyLoadingError("loading"),
    rx.MaxConnectionsError("pool full"),
    rx.AuthenticationError("auth"),
    rx.TimeoutError("slow"),
    rx.ReadOnlyError("replica"),
    rx.ClusterDownError("down"),
    rx.MasterDownError("master down"),
    rx.TryAgainError("migrating"),
    rx.MovedError("1 127.0.0.1:7000"),
    rx.OutOfMemoryError("command not allowed when used memory > 'maxmemory'."),
    rx.NoPermissionError("acl"),
    rx.SlotNotCoveredError("slot"),
    rx.RedisClusterUnreachableError("nodes"),
    rx.ResponseError("BUSY Redis is busy running a script."),
    rx.ResponseError("NOREPLICAS Not enough good replicas to write."),
    rx.ResponseError("MISCONF Redis is configured to save RDB snapshots, but it's failing"),
]
THE_CALLS_OWN = [
    rx.ClusterCrossSlotError("Keys in request don't hash to the same slot"),
    rx.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"),
    rx.ResponseError("ERR Error running script: attempt to compare nil with number"),
    rx.DataError("invalid input"),
    rx.NoScriptError("NOSCRIPT"),
]


@pytest.mark.parametrize("error", UNAVAILABLE, ids=lambda e: type(e).__name__ + str(e)[:8])
def test_the_store_cannot_serve_now(error: Exception) -> None:
    assert redis_unavailable(error)
    assert is_infrastructure(error)


@pytest.mark.parametrize("error", THE_CALLS_OWN, ids=lambda e: type(e).__name__ + str(e)[:8])
def test_the_call_itself_is_wrong(error: Exception) -> None:
    assert not redis_unavailable(error)
    assert not is_infrastructure(error)


def test_a_store_wrapper_and_os_errors_are_infrastructure_not_redis() -> None:
    assert is_infrastructure(StoreUnavailable("x"))
    assert is_infrastructure(OSError("reset"))
    assert not redis_unavailable(ValueError("x"))
