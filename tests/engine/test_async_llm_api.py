"""vLLM's asyncio API, `AsyncLLM.from_engine_args` and `generate`, on a real engine core process
(a random 2-layer llama with SmolLM2's tokenizer): the same greedy tokens as `LLM`, whatever the
output kind or how many requests run at once; closing a request's iteration early, or `abort`
with its id, aborts it;
bad input fails the request, not the engine; vLLM's engine calls (`reset_prefix_cache`,
`start_profile` / `stop_profile`, `check_health`) work; `shutdown` ends what runs and leaves
nothing."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from tests.entrypoints.openai.server_utils import make_tiny_checkpoint
from tests.timeouts import scaled
from v1engine import AsyncLLM, EngineArgs, SamplingParams
from v1engine.engine.core_process import EngineDeadError, RequestAbortedError
from v1engine.entrypoints.llm import LLM

_ENGINE_ARGS = dict(device="cpu", dtype="float32", max_model_len=128, kv_cache_memory_bytes=8 << 20)
PROMPT = "The quick brown fox jumps over the lazy dog and then"
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_model")))


@pytest.fixture(scope="module")
def expected(checkpoint) -> list[int]:
    with LLM(checkpoint, **_ENGINE_ARGS) as llm:
        return llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def _run(checkpoint: str, body) -> object:
    """Runs `body(engine)` on a fresh engine, within a time limit, and shuts it down."""

    async def main():
        async with AsyncLLM.from_engine_args(EngineArgs(model=checkpoint, **_ENGINE_ARGS)) as e:
            return await asyncio.wait_for(body(e), scaled(120))

    return asyncio.run(main())


async def _collect(outputs) -> list:
    return [output async for output in outputs]


def test_generate_gives_llms_tokens_in_every_output_kind(checkpoint, expected):
    async def body(engine: AsyncLLM):
        cumulative = await _collect(engine.generate(PROMPT, GREEDY, "a"))
        deltas = await _collect(engine.generate(PROMPT, GREEDY, "b", output_kind="delta"))
        together = await asyncio.gather(
            *(
                _collect(engine.generate(PROMPT, GREEDY, f"c{i}", output_kind="final"))
                for i in range(3)
            )
        )
        return cumulative, deltas, together

    cumulative, deltas, together = _run(checkpoint, body)
    assert cumulative[-1].finished and cumulative[-1].outputs[0].token_ids == expected
    for earlier, later in zip(cumulative, cumulative[1:]):  # each holds all so far
        tokens = later.outputs[0].token_ids
        assert tokens[: len(earlier.outputs[0].token_ids)] == earlier.outputs[0].token_ids
    assert [t for d in deltas for t in d.outputs[0].token_ids] == expected
    assert "".join(d.outputs[0].text for d in deltas) == cumulative[-1].outputs[0].text
    for outputs in together:
        assert len(outputs) == 1 and outputs[0].outputs[0].token_ids == expected


def test_leaving_early_aborts_and_bad_input_fails_only_its_request(checkpoint, expected):
    async def body(engine: AsyncLLM):
        long = SamplingParams(max_tokens=100, ignore_eos=True)
        async with contextlib.aclosing(engine.generate(PROMPT, long, "x")) as outputs:
            async for _ in outputs:
                break  # closed here: the request is aborted, its id is free again
        assert not engine.output_processor.has_unfinished_requests()
        with pytest.raises(ValueError, match="max_tokens must be >= 1"):
            await _collect(engine.generate(PROMPT, SamplingParams(max_tokens=0), "y"))
        with pytest.raises(ValueError, match="a prompt must be a str"):
            await _collect(engine.generate(3.5, GREEDY, "z"))  # type: ignore[arg-type]
        # Aborted by its id (vLLM's abort, synchronous here): its reader is told.
        outputs = engine.generate(PROMPT, long, "w")
        await anext(outputs)
        engine.abort("w")
        with pytest.raises(RequestAbortedError, match="was aborted"):
            await _collect(outputs)
        assert not engine.output_processor.has_unfinished_requests()
        # The aborted request's id again: only the new request's outputs come (the old one's
        # last outputs may still be on their way).
        return await _collect(engine.generate({"prompt": PROMPT}, GREEDY, "x"))

    outputs = _run(checkpoint, body)
    assert {o.request_id for o in outputs} == {"x"}
    assert outputs[-1].outputs[0].token_ids == expected


def test_shutdown_ends_running_requests_and_refuses_new_ones(checkpoint):
    async def main():
        engine = AsyncLLM.from_engine_args(EngineArgs(model=checkpoint, **_ENGINE_ARGS))
        outputs = engine.generate(PROMPT, SamplingParams(max_tokens=100, ignore_eos=True), "a")
        await anext(outputs)
        await engine.check_health()
        engine.shutdown()
        with pytest.raises(EngineDeadError, match="the engine was shut down"):
            await asyncio.wait_for(_collect(outputs), scaled(60))
        with pytest.raises(EngineDeadError):
            await engine.check_health()
        with pytest.raises(EngineDeadError):
            await _collect(engine.generate(PROMPT, GREEDY, "b"))
        engine.shutdown()  # idempotent

    asyncio.run(main())


def test_vllms_engine_calls(checkpoint, expected, tmp_path):
    async def main():
        profiler = {"profiler": "torch", "torch_profiler_dir": str(tmp_path)}
        args = EngineArgs(model=checkpoint, profiler_config=profiler, **_ENGINE_ARGS)
        async with AsyncLLM.from_engine_args(args) as engine:
            await engine.start_profile()
            (output,) = await _collect(engine.generate(PROMPT, GREEDY, "a", output_kind="final"))
            await engine.stop_profile()
            with pytest.raises(RuntimeError, match="no profile is running"):
                await engine.stop_profile()
            return output.outputs[0].token_ids, await engine.reset_prefix_cache()

    token_ids, reset = asyncio.run(main())
    assert token_ids == expected and reset
    assert list(tmp_path.glob("rank0.*.pt.trace.json.gz"))


def test_a_bad_model_fails_before_anything_starts(tmp_path):
    with pytest.raises(ValueError, match="neither a local directory with a config.json"):
        AsyncLLM.from_engine_args(EngineArgs(model=str(tmp_path / "missing"), device="cpu"))
