"""Control-event signatures (``services.common.control_signing``): what a signature
proves, what each principal may issue, and the key files."""

from __future__ import annotations

import stat
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given
from hypothesis import strategies as st

from schemas import ControlEvent, Evidence, Profile, QuotaOverride
from seawall_client.serde import encode
from services.common.control_signing import (
    HEADER_SIGNATURE,
    HEADER_SIGNER,
    ControlKeysMissing,
    ControlSigner,
    ControlVerifier,
    authorized,
    ensure_keys,
    load_signer,
    load_verifier,
    parse_trusted,
    public_line,
    signer_for,
    verifier_for,
)
from services.common.settings import CommonSettings


def override(issuer: str, tenant: str = "victim", burst: float | None = 0.0) -> QuotaOverride:
    now = time.time()
    return QuotaOverride(
        scope=f"tenant:{tenant}",
        seq=int(now * 1_000_000),
        issued_at=now,
        issuer=issuer,
        evidence=Evidence(reason="test"),
        tenant=tenant,
        burst=burst,
    )


def profile_answer(worker: str, issuer: str | None = None) -> Profile:
    now = time.time()
    return Profile(
        scope=f"worker:{worker}",
        seq=int(now * 1_000_000),
        issued_at=now,
        issuer=issuer or f"worker:{worker}",
        evidence=Evidence(reason="profile written"),
        worker_id=worker,
        request=1,
        seconds=1.0,
        status="written",
    )


CONTROLLER = ControlSigner("controller", Ed25519PrivateKey.generate())
WORKER = ControlSigner("worker", Ed25519PrivateKey.generate())
ALICE = ControlSigner("operator:alice", Ed25519PrivateKey.generate())
VERIFIER = ControlVerifier({s.principal: s.key.public_key() for s in (CONTROLLER, WORKER, ALICE)})


def check(signer: ControlSigner | None, event: ControlEvent, value: bytes | None = None) -> object:
    raw = encode(event)
    headers = None if signer is None else signer.headers(raw)
    return VERIFIER.check(raw if value is None else value, headers, event)


def test_each_principal_signs_what_it_may_issue() -> None:
    assert check(ALICE, override("operator:alice")) is None
    assert check(CONTROLLER, override("controller")) is None
    assert check(WORKER, profile_answer("w1")) is None


def test_an_unsigned_event_is_refused() -> None:
    assert check(None, override("controller")) == "unsigned"


def test_a_key_nobody_trusts_is_refused() -> None:
    stranger = ControlSigner("controller", Ed25519PrivateKey.generate())
    assert check(stranger, override("controller")) == "bad_signature"
    mallory = ControlSigner("operator:mallory", Ed25519PrivateKey.generate())
    assert check(mallory, override("operator:mallory")) == "unknown_signer"


def test_a_signature_does_not_carry_over_to_another_value() -> None:
    genuine = override("operator:alice", burst=100.0)
    forged = override("operator:alice", burst=0.0)
    headers = ALICE.headers(encode(genuine))
    assert VERIFIER.check(encode(forged), headers, forged) == "bad_signature"


def test_a_signature_does_not_carry_over_to_another_signer() -> None:
    """The principal is part of what is signed: alice's signature under the
    controller's name is no signature."""
    event = override("controller")
    raw = encode(event)
    headers = [(HEADER_SIGNER, b"controller"), ALICE.headers(raw)[1]]
    assert VERIFIER.check(raw, headers, event) == "bad_signature"


def test_no_principal_issues_in_another_ones_name() -> None:
    assert check(ALICE, override("controller")) == "not_authorized"
    assert check(ALICE, override("operator:bob")) == "not_authorized"
    assert check(CONTROLLER, override("operator:alice")) == "not_authorized"
    # The workers' shared key answers profiling requests about the worker itself, only.
    assert check(WORKER, override("worker:w1")) == "not_authorized"
    assert check(WORKER, profile_answer("w1", issuer="worker:w2")) == "not_authorized"


@given(
    st.lists(st.tuples(st.text(max_size=30), st.binary(max_size=200)), max_size=4),
)
def test_garbage_headers_are_unsigned_or_bad_never_an_error(
    headers: list[tuple[str, bytes]],
) -> None:
    event = override("controller")
    assert VERIFIER.check(encode(event), headers, event) in (
        "unsigned",
        "unknown_signer",
        "bad_signature",
    )


def test_malformed_signature_headers_are_unsigned() -> None:
    event = override("controller")
    raw = encode(event)
    for headers in (
        [(HEADER_SIGNER, b"controller")],
        [(HEADER_SIGNER, b"controller"), (HEADER_SIGNATURE, b"not base64!")],
        [(HEADER_SIGNER, b"\xff"), (HEADER_SIGNATURE, b"AAAA")],
        [(HEADER_SIGNER, b"controller"), (HEADER_SIGNATURE, b"A" * 4096)],
    ):
        assert VERIFIER.check(raw, headers, event) == "unsigned"


def test_keys_made_once_owner_only_and_read_back(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    ensure_keys(keys, "operator:alice")
    first = {p.name: p.read_text() for p in keys.iterdir()}
    ensure_keys(keys, "operator:alice")  # a second start keeps them
    assert {p.name: p.read_text() for p in keys.iterdir()} == first
    for role in ("controller", "worker", "operator"):
        path = keys / f"{role}.key"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    verifier = load_verifier(keys)
    assert verifier.principals == {"controller", "worker", "operator:alice"}
    signer = load_signer(keys, "operator")
    event = override("operator:alice")
    assert verifier.check(encode(event), signer.headers(encode(event)), event) is None


def test_a_bad_trust_file_is_refused_not_half_read() -> None:
    good = public_line("controller", Ed25519PrivateKey.generate().public_key())
    with pytest.raises(ValueError, match="line 2"):
        parse_trusted(good + "\nworker rsa AAAA\n")
    with pytest.raises(ValueError, match="principal"):
        parse_trusted("root ed25519 AAAA\n")


def test_settings_without_keys_refuse_to_start_unless_signatures_are_off() -> None:
    required = CommonSettings(_env_file=None)
    with pytest.raises(ControlKeysMissing):
        verifier_for(required)
    with pytest.raises(ControlKeysMissing):
        signer_for(required, "controller")
    off = CommonSettings(_env_file=None, control_signatures="off")
    assert verifier_for(off) is None
    assert signer_for(off, "operator") is None


def test_an_operator_key_cannot_be_made_for_the_controller(tmp_path: Path) -> None:
    from services.common.control_signing import make_key

    with pytest.raises(ValueError, match="signs as"):
        make_key(tmp_path, "worker", "controller")
    assert authorized("controller", override("controller"))
    assert not authorized("operator:alice", override("controller"))
