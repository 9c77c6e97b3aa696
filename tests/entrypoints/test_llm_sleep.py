"""Sleep mode (vLLM's `enable_sleep_mode`, `LLM.sleep` / `wake_up`) on real worker processes: a
level-1 sleep gives each worker's KV cache back to the OS (its mapped memory drops by the
cache's size; on CPU the weights stay), a level-2 sleep frees the weights too, generation is
refused while asleep, and once woken (after level 2, weights first, then the checkpoint read
again, then the KV cache) the engine gives exactly the tokens it gave before sleeping, with no
stale cached prefix."""

from __future__ import annotations

import pytest

from tests.entrypoints.llm_utils import GREEDY, PROMPTS, make_llm, token_ids
from tests.entrypoints.weight_sync import (
    cuda_reserved_bytes,
    has_cuda_graphs,
    weight_storage_bytes,
    worker_vms,
)

KV_BYTES = 64 << 20


def generate(llm) -> list[list[int]]:
    return token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))


@pytest.mark.parametrize("tp", [1, 2])
def test_sleep_gives_the_memory_back_and_waking_gives_the_same_tokens(llama_checkpoint, tp):
    llm = make_llm(
        llama_checkpoint,
        tensor_parallel_size=tp,
        enable_sleep_mode=True,
        kv_cache_memory_bytes=KV_BYTES,
    )
    with llm:
        awake = generate(llm)  # also caches the prompts' prefixes
        mapped_awake = llm.collective_rpc(worker_vms)
        weights = llm.collective_rpc(weight_storage_bytes)

        llm.sleep(level=1)
        assert llm.llm_engine.is_sleeping()
        freed = [a - b for a, b in zip(mapped_awake, llm.collective_rpc(worker_vms))]
        assert all(f > 0.9 * KV_BYTES for f in freed), (freed, KV_BYTES)
        assert llm.collective_rpc(weight_storage_bytes) == weights  # on CPU they stay
        with pytest.raises(ValueError, match=r"asleep \(sleep level 1\); call wake_up\(\)"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        llm.wake_up()
        assert not llm.llm_engine.is_sleeping()
        assert generate(llm) == awake  # a cached prefix would now read a zeroed cache

        llm.sleep(level=2)
        assert llm.collective_rpc(weight_storage_bytes) == [0] * tp
        llm.wake_up(tags=["weights"])
        assert llm.llm_engine.is_sleeping()  # the KV cache still sleeps
        assert llm.collective_rpc(weight_storage_bytes) == weights
        llm.collective_rpc("reload_weights")  # level 2 woke undefined weights
        llm.wake_up(tags=["kv_cache"])
        assert generate(llm) == awake


def test_sleep_mode_refuses_what_it_cannot_do(llama_checkpoint):
    with make_llm(llama_checkpoint) as llm:
        with pytest.raises(RuntimeError, match=r"enable_sleep_mode=True \(--enable-sleep-mode\)"):
            llm.sleep()
        assert generate(llm)  # nothing happened
    with make_llm(llama_checkpoint, enable_sleep_mode=True) as llm:
        with pytest.raises(ValueError, match="sleep level must be 1 .* or 2 .*, got 3"):
            llm.sleep(level=3)
        with pytest.raises(ValueError, match=r"wake_up tags must be a list of \['weights', 'kv_c"):
            llm.wake_up(tags=["gpu"])
        llm.wake_up()  # awake already: nothing to do
        llm.sleep(level=1)
        with pytest.raises(RuntimeError, match=r"asleep already \(level 1\)"):
            llm.sleep(level=2)
        llm.wake_up()
        assert generate(llm)


@pytest.mark.gpu
def test_on_cuda_sleep_frees_the_device_memory_and_waking_restores_it(llama_checkpoint):
    llm = make_llm(
        llama_checkpoint, device="cuda", enable_sleep_mode=True, kv_cache_memory_bytes=KV_BYTES
    )
    with llm:
        awake = generate(llm)
        [reserved] = llm.collective_rpc(cuda_reserved_bytes)
        [weights] = llm.collective_rpc(weight_storage_bytes)
        assert llm.collective_rpc(has_cuda_graphs) == [True]
        for level in (1, 2):
            llm.sleep(level=level)
            [asleep] = llm.collective_rpc(cuda_reserved_bytes)
            assert reserved - asleep >= 0.9 * (KV_BYTES + weights), (reserved, asleep, weights)
            assert llm.collective_rpc(has_cuda_graphs) == [False]  # they held the old addresses
            llm.wake_up(tags=["weights"])
            if level == 2:  # woken undefined: the weights come from the checkpoint again
                llm.collective_rpc("reload_weights")
            llm.wake_up(tags=["kv_cache"])
            assert llm.collective_rpc(has_cuda_graphs) == [True]  # captured again
            assert generate(llm) == awake  # level 1: the weights came back from host memory
