"""The in-process vLLM engine, for real: needs the ``vllm`` extra, a CUDA GPU and a model
(``SEAWALL_VLLM_TEST_MODEL``, default ``facebook/opt-125m``, from the Hugging Face cache or
the network). Skipped anywhere else; there is no stand-in for vLLM."""

import os

import pytest

vllm = pytest.importorskip("vllm", reason="the in-process engine needs the vllm extra")
torch = pytest.importorskip("torch", reason="vLLM needs torch")
if not torch.cuda.is_available():
    pytest.skip("the in-process vLLM engine needs a CUDA GPU", allow_module_level=True)

from collections.abc import AsyncIterator  # noqa: E402

from services.workers.engine.base import EngineOutput, EngineRequest  # noqa: E402
from services.workers.engine.vllm_engine import VllmEngine, VllmEngineConfig  # noqa: E402

pytestmark = [pytest.mark.unit, pytest.mark.vllm]

MODEL = os.environ.get("SEAWALL_VLLM_TEST_MODEL", "facebook/opt-125m")


@pytest.fixture
async def engine() -> AsyncIterator[VllmEngine]:
    engine = VllmEngine(
        VllmEngineConfig(
            model=MODEL,
            max_model_len=512,
            max_num_seqs=8,
            max_num_batched_tokens=2048,
            block_size=16,
            gpu_memory_utilization=0.3,
            scheduling_policy="priority",
            extra_args={"enforce_eager": True},
        )
    )
    await engine.start()
    yield engine
    await engine.stop()


def _request(request_id: str, max_tokens: int, priority: int = 0) -> EngineRequest:
    return EngineRequest(
        request_id=request_id,
        prompt="The capital of France is",
        prompt_tokens=6,
        max_tokens=max_tokens,
        temperature=0.0,
        priority=priority,
    )


async def test_generate_streams_deltas_to_a_final_output(engine: VllmEngine) -> None:
    outputs = [out async for out in engine.generate(_request("r1", max_tokens=8, priority=-1))]
    final = outputs[-1]
    assert final.finished
    assert final.finish_reason in {"stop", "length"}
    assert not any(out.finished for out in outputs[:-1])
    assert final.completion_tokens == sum(out.new_tokens for out in outputs) <= 8
    assert final.prompt_tokens > 0
    assert "".join(out.text for out in outputs)


async def test_limits_come_from_the_running_engine(engine: VllmEngine) -> None:
    limits = engine.limits
    assert limits.max_num_seqs == 8
    assert limits.block_size == 16
    assert limits.kv_capacity_tokens >= limits.max_model_len


async def test_scheduler_stats_reach_the_snapshot(engine: VllmEngine) -> None:
    async for _ in engine.generate(_request("r2", max_tokens=16)):
        pass
    snapshot = engine.snapshot()
    assert snapshot.generation_tokens_total > 0
    assert snapshot.prompt_tokens_total > 0


async def test_abort_ends_the_stream_with_abort(engine: VllmEngine) -> None:
    outputs: list[EngineOutput] = []
    async for out in engine.generate(_request("r3", max_tokens=400)):
        outputs.append(out)
        if len(outputs) == 1:
            await engine.abort("r3")
    assert outputs[-1].finished
    assert outputs[-1].finish_reason == "abort"
