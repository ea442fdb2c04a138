"""The fleet's sampling secret (services.common.sampling): read from its file, refused
when it is no secret, made owner-only once, and required by the services that sample."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from services.admission.service import Admission
from services.admission.settings import AdmissionSettings
from services.common.sampling import (
    MAX_BYTES,
    MIN_BYTES,
    SamplingSecretMissing,
    load_secret,
    make_secret,
    parse_secret,
    sampling_secret,
)
from services.common.settings import CommonSettings

pytestmark = pytest.mark.unit


def test_a_secret_is_32_to_64_bytes_of_hex() -> None:
    assert parse_secret("ab" * 32 + "\n") == bytes([0xAB]) * 32
    assert parse_secret(" " + "0f" * MAX_BYTES + " ") == bytes([0x0F]) * MAX_BYTES
    for bad in ("", "ab" * (MIN_BYTES - 1), "ab" * (MAX_BYTES + 1), "zz" * 32, "abc"):
        with pytest.raises(ValueError, match="sampling secret"):
            parse_secret(bad)


def test_made_once_owner_only_and_never_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "state" / "sampling_secret"
    assert make_secret(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    first = load_secret(path)
    assert len(first) == MIN_BYTES
    assert not make_secret(path)
    assert load_secret(path) == first
    other = tmp_path / "other"
    make_secret(other)
    assert load_secret(other) != first  # random, not a constant


def test_the_setting_names_the_file_and_blank_means_none(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text("cd" * 40)
    assert sampling_secret(CommonSettings(_env_file=None, sampling_secret_file=path)) == (
        bytes([0xCD]) * 40
    )
    assert CommonSettings(_env_file=None, sampling_secret_file=" ").sampling_secret_file is None
    with pytest.raises(SamplingSecretMissing, match="SEAWALL_SAMPLING_SECRET_FILE"):
        sampling_secret(CommonSettings(_env_file=None))
    with pytest.raises(SamplingSecretMissing, match="cannot read"):
        sampling_secret(CommonSettings(_env_file=None, sampling_secret_file=tmp_path / "none"))


def test_admission_does_not_start_without_the_secret() -> None:
    """No fallback: an unkeyed hash would let producers aim their ids again, and a random
    secret per process would split one session between the canary and the baseline
    across replicas."""
    settings = AdmissionSettings(_env_file=None, control_signatures="off")
    with pytest.raises(SamplingSecretMissing):
        Admission(settings)
