"""Which profiling requests a worker takes (``profiling.Profiles``) and its answers."""

from __future__ import annotations

from schemas import Evidence, Profile
from services.workers.profiling import Profiles, answer

NOW = 1_000_000.0


def request(worker: str = "w1", seq: int = 5, issued_at: float = NOW) -> Profile:
    return Profile(
        scope=f"worker:{worker}",
        seq=seq,
        issued_at=issued_at,
        valid_for_s=60,
        issuer="operator:me",
        evidence=Evidence(reason="why"),
        worker_id=worker,
        request=seq,
        seconds=2,
        status="requested",
    )


def test_a_request_is_taken_once_by_its_worker_while_in_force() -> None:
    profiles = Profiles("w1")
    assert not profiles.take(request(worker="w2"), NOW)  # another worker's
    assert not profiles.take(request(issued_at=NOW - 61), NOW)  # no longer in force
    assert profiles.take(request(), NOW)
    assert not profiles.take(request(), NOW + 1)  # the same request, read again
    profiles.running = True
    assert not profiles.take(request(seq=6), NOW + 1)  # one at a time
    profiles.running = False
    assert profiles.take(request(seq=6), NOW + 1)


def test_answers_follow_the_request_on_its_key_as_the_worker() -> None:
    asked = request()
    written = answer(asked, "written", "profile written", "/tmp/w1-5.prof")
    assert written.control_key == asked.control_key
    assert written.seq > asked.seq
    assert (written.status, written.path, written.issuer) == (
        "written",
        "/tmp/w1-5.prof",
        "worker:w1",
    )
    assert written.request == asked.request
    assert not profiles_take_answers(written)


def profiles_take_answers(event: Profile) -> bool:
    return Profiles("w1").take(event, event.issued_at)
