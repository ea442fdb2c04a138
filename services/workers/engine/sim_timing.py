"""The simulated engine's step-time model, calibrated to vLLM on Llama-2-7B / A100.

Step time is CALIBRATION's model (``CALIBRATION.md`` in the shared design folder),
coefficients from :func:`.profiles.step_coefficients`:
``t = c0 + sqrt(F² + (s·N)²) + k_kv·Σ decode contexts + k_pf·Σ c_j·(p_j + c_j/2)``.
On Llama-2-7B / A100 it gives a 10.96 ms decode step at batch 1 (FlightLLM measured
11.2–11.5 ms), 22.2 ms at 64 and 35.0 ms at 128 sequences of 512 tokens, and a 36.7 ms
prefill of 512 tokens (measured TTFT 40.4 ms).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from services.workers.engine.profiles import StepCoefficients
from services.workers.engine.sim_requests import SimRequest


def step_time_ms(
    c: StepCoefficients,
    scheduled: Sequence[tuple[SimRequest, int]],
    *,
    step_time_scale: float,
    slowdown: float,
) -> float:
    """Milliseconds of the step that runs ``scheduled`` (requests with their token counts).

    ``step_time_scale`` is :attr:`.sim_config.SimConfig.step_time_scale`, ``slowdown``
    the fault's step-time multiplier."""
    tokens = 0
    decode_context = 0
    prefill_work = 0.0
    for req, n in scheduled:
        tokens += n
        if n == 1 and req.output_tokens and req.num_computed == req.num_tokens - 1:
            decode_context += req.num_tokens
        else:
            prefill_work += n * (req.num_computed + n / 2)
    t = (
        c.c0_ms
        + math.hypot(c.F_ms, c.s_ms_per_token * tokens)
        + c.k_kv_ms_per_token * decode_context
        + c.k_pf_ms * prefill_work
    )
    return t * step_time_scale * slowdown
