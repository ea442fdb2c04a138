"""Model and GPU profiles: the corrected KV figures of DESIGN and CALIBRATION's capacity."""

from __future__ import annotations

import pytest

from services.workers.engine.profiles import (
    GPUS,
    MODELS,
    kv_bytes_per_token,
    kv_capacity_blocks,
    kv_capacity_tokens,
    step_coefficients,
)

pytestmark = pytest.mark.unit

MIB = 1024**2


@pytest.mark.parametrize(
    ("model", "mib_per_token"),
    [
        ("llama-2-7b", 0.5),
        ("llama-2-13b", 0.78125),
        ("llama-3-8b", 0.125),
        ("codellama-34b", 0.1875),
        ("llama-3.2-1b", 0.03125),  # 16 layers x 8 KV heads x 64 wide
    ],
)
def test_kv_bytes_per_token_follow_the_architecture(model: str, mib_per_token: float) -> None:
    assert kv_bytes_per_token(MODELS[model]) / MIB == mib_per_token


def test_design_corrections_of_the_seed_kv_table() -> None:
    # DESIGN, "Seed code to fix": 7B/512 ≈ 256 MiB, 13B/1024 ≈ 800 MiB, 34B GQA/2048 ≈ 384 MiB.
    assert kv_bytes_per_token(MODELS["llama-2-7b"]) * 512 / MIB == 256
    assert kv_bytes_per_token(MODELS["llama-2-13b"]) * 1024 / MIB == 800
    assert kv_bytes_per_token(MODELS["codellama-34b"]) * 2048 / MIB == 384


def test_llama_2_7b_on_a100_gets_flightllm_block_count() -> None:
    model, gpu = MODELS["llama-2-7b"], GPUS["a100-80g"]
    assert kv_capacity_blocks(model, gpu, 0.9, 16) == 7449
    assert kv_capacity_tokens(model, gpu, 0.9, 16) == 119_184


def test_capacity_follows_memory_utilization_and_model_size() -> None:
    gpu = GPUS["a100-80g"]
    seven_b = MODELS["llama-2-7b"]
    assert kv_capacity_tokens(seven_b, gpu, 0.85, 16) < kv_capacity_tokens(seven_b, gpu, 0.9, 16)
    # Fewer KV heads hold more tokens in less memory.
    assert kv_capacity_tokens(MODELS["llama-3-8b"], gpu, 0.9, 16) > 3 * 119_184
    # The 34B's weights leave room for little KV; a model that does not fit gets none.
    assert 0 < kv_capacity_tokens(MODELS["codellama-34b"], gpu, 0.9, 16) < 119_184
    assert kv_capacity_tokens(MODELS["codellama-34b"], gpu, 0.5, 16) == 0


def test_measured_coefficients_win_and_others_scale_from_llama_2_7b() -> None:
    a100, h100 = GPUS["a100-80g"], GPUS["h100-80g"]
    assert step_coefficients(MODELS["llama-2-7b"], a100) == a100.step
    assert step_coefficients(MODELS["llama-2-7b"], h100) == h100.step
    llama3 = step_coefficients(MODELS["llama-3-8b"], a100)
    assert (llama3.F_ms, llama3.s_ms_per_token, llama3.k_kv_ms_per_token) == (10.1, 0.067, 0.08e-3)
    thirteen = step_coefficients(MODELS["llama-2-13b"], a100)
    assert thirteen.F_ms == pytest.approx(a100.step.F_ms * 13_015_864_320 / 6_738_415_616)
    assert thirteen.k_kv_ms_per_token == pytest.approx(a100.step.k_kv_ms_per_token * 800 / 512)
    assert thirteen.c0_ms == a100.step.c0_ms


def test_the_small_pool_model_steps_faster_than_the_reference() -> None:
    gpu = GPUS["a100-80g"]
    small = step_coefficients(MODELS["llama-3.2-1b"], gpu)
    ref = step_coefficients(MODELS["llama-2-7b"], gpu)
    assert small.F_ms < ref.F_ms / 4
    assert small.k_kv_ms_per_token < ref.k_kv_ms_per_token / 10
