"""KV cache allocation and memory sizing on CPU workers.

The caches must have exactly the layout the unified `KVCacheConfig` describes, cost the process
about the bytes promised (zero-filling commits the pages), and scale with
`kv_cache_memory_bytes`; without it, the CPU budget is a fair share of the host's memory.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from tests.model.checkpoints import make_checkpoint
from tests.worker.worker_utils import (
    executor_step,
    expected_spin_count,
    kv_cache_layout,
    make_engine_config,
    make_prompts,
    make_request,
    make_scheduler,
    memory_profile,
    rss_bytes,
    run_kv_cache_handshake,
    run_requests,
    touch_kv_caches,
    worker_huge_pages,
    worker_spin_count,
    worker_threads,
)
from v1engine.config import SpeculativeConfig
from v1engine.core.kv_cache_utils import get_kv_cache_configs
from v1engine.executor.multiproc_executor import MultiprocExecutor
from v1engine.executor.uniproc_executor import UniProcExecutor
from v1engine.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from v1engine.worker.gpu_worker import CPU_DEFAULT_KV_CACHE_BYTES
from v1engine.worker.kv_cache import kv_cache_group_specs
from v1engine.worker.memory import host_memory_bytes

KV_BYTES = 64 << 20


@pytest.fixture(scope="module")
def hybrid_path(tmp_path_factory) -> str:
    return make_checkpoint(tmp_path_factory.mktemp("kv_cache"), "qwen2_hybrid")


@pytest.fixture(scope="module")
def hybrid_tp2(hybrid_path):
    """A TP=2 hybrid model (two KV cache groups sharing one tensor), with RSS measured around
    initialize_from_config: (executor, configs, rss_before, rss_after)."""
    executor = MultiprocExecutor(make_engine_config(hybrid_path, 2, kv_cache_memory_bytes=KV_BYTES))
    try:
        config = executor.config
        specs = executor.get_kv_cache_specs()
        available = executor.determine_available_memory()
        configs = get_kv_cache_configs(
            config.cache_config, config.scheduler_config, specs, available
        )
        rss_before = executor.collective_rpc(rss_bytes)
        executor.initialize_from_config(configs)
        rss_after = executor.collective_rpc(rss_bytes)
        yield executor, configs, rss_before, rss_after
    finally:
        executor.shutdown()


def test_kv_caches_have_the_configured_layout(hybrid_tp2):
    executor, configs, _, _ = hybrid_tp2
    layouts = executor.collective_rpc(kv_cache_layout)
    for config, layout in zip(configs, layouts):
        assert len(config.kv_cache_groups) == 2  # full attention + sliding window
        group_spec = {
            name: group.kv_cache_spec
            for group in config.kv_cache_groups
            for name in group.layer_names
        }
        assert sorted(layout) == sorted(group_spec)
        for tensor in config.kv_cache_tensors:
            key_ptrs = set()
            for name in tensor.shared_by:
                spec = group_spec[name]
                key_shape, value_shape, dtype, key_ptr, value_ptr, is_bound = layout[name]
                expected = (config.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
                assert key_shape == value_shape == expected
                assert dtype == spec.dtype == torch.float32
                assert spec.num_kv_heads == 1  # 2 KV heads split over 2 ranks
                # K is the first half of the tensor's bytes, V the second.
                assert value_ptr - key_ptr == tensor.size // 2
                assert is_bound
                key_ptrs.add(key_ptr)
            assert len(key_ptrs) == 1, "layers sharing a KVCacheTensor must view one buffer"


def kv_cache_group_indices(worker) -> dict[str, int | None]:
    return {
        name: layer.kv_cache_group_index for name, layer in worker.model_runner.attn_layers.items()
    }


def test_layers_know_their_kv_cache_group(hybrid_tp2):
    executor, configs, _, _ = hybrid_tp2
    for config, indices in zip(configs, executor.collective_rpc(kv_cache_group_indices)):
        groups = config.kv_cache_groups
        assert indices == {name: g for g, group in enumerate(groups) for name in group.layer_names}


def test_each_group_builds_metadata_for_one_attention_spec():
    full = FullAttentionSpec(16, 2, 64, torch.float16)
    window = SlidingWindowSpec(16, 2, 64, torch.float16, sliding_window=8)
    wide = FullAttentionSpec(16, 4, 64, torch.float16)
    groups = [KVCacheGroupSpec(["a", "b"], full), KVCacheGroupSpec(["c"], window)]
    assert kv_cache_group_specs(KVCacheConfig(4, [], groups)) == [full, window]
    # Layers of one type with different pages: the largest stands for the group.
    uniform = UniformTypeKVCacheSpecs(16, {"a": full, "b": wide})
    config = KVCacheConfig(4, [], [KVCacheGroupSpec(["a", "b"], uniform)])
    assert kv_cache_group_specs(config) == [wide]


def test_cpu_cache_is_finite_and_commits_its_pages_on_first_touch(hybrid_tp2):
    executor, configs, rss_before, rss_after = hybrid_tp2
    touched = executor.collective_rpc(touch_kv_caches)
    for config, before, after, (all_finite, rss_touched) in zip(
        configs, rss_before, rss_after, touched
    ):
        promised = sum(tensor.size for tensor in config.kv_cache_tensors)
        assert promised > 0.99 * KV_BYTES
        assert all_finite  # a NaN in a masked slot would still poison attention
        # Allocation maps the cache without committing it (the warm-up adds a little) ...
        assert after - before <= 24 << 20, (after - before, promised)
        # ... and writing every byte commits every page it promised.
        assert 0.95 * promised <= rss_touched - before <= promised + (24 << 20)


def test_cpu_workers_get_disjoint_cores_and_a_fair_memory_share(hybrid_tp2):
    executor, _, _, _ = hybrid_tp2
    num_cpus = len(os.sched_getaffinity(0))
    threads = executor.collective_rpc(worker_threads)
    for num_threads, _, device in threads:
        assert device == "cpu"
        assert num_threads == max(1, num_cpus // 2)
    if num_cpus >= 2:
        assert not set(threads[0][1]) & set(threads[1][1])
    expected = expected_spin_count()
    assert executor.collective_rpc(worker_spin_count) == [expected, expected]
    for profile in executor.collective_rpc(memory_profile):
        assert profile.total_bytes == host_memory_bytes()
        assert profile.budget_bytes == int(profile.total_bytes * 0.9 / 2)
        assert profile.weights_bytes > 0 and profile.activation_peak_bytes >= 0
        assert 0 <= profile.available_kv_bytes <= profile.budget_bytes - profile.weights_bytes


def _thp_left_to_programs() -> bool:
    """Whether the kernel gives transparent huge pages to memory a program asks them for, and
    glibc's malloc can ask (2.35 and later)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        return False
    glibc = os.confstr("CS_GNU_LIBC_VERSION") or ""
    version = tuple(int(part) for part in glibc.split()[-1].split(".")[:2]) if glibc else (0, 0)
    return ("[madvise]" in mode or "[always]" in mode) and version >= (2, 35)


def test_cpu_workers_put_large_tensors_in_huge_pages(hybrid_tp2):
    executor, _, _, _ = hybrid_tp2
    expected = os.environ.get("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
    for tunables, grown_kib in executor.collective_rpc(worker_huge_pages):
        assert tunables == expected
        if _thp_left_to_programs() and "GLIBC_TUNABLES" not in os.environ:
            assert grown_kib >= 32 * 1024, "a 64 MiB tensor should sit mostly in 2 MiB pages"


def _num_blocks(path: str, kv_cache_memory_bytes: int) -> int:
    executor = UniProcExecutor(
        make_engine_config(path, kv_cache_memory_bytes=kv_cache_memory_bytes)
    )
    try:
        assert executor.determine_available_memory() == [kv_cache_memory_bytes]
        return run_kv_cache_handshake(executor)[0].num_blocks
    finally:
        executor.shutdown()


def test_smaller_kv_cache_memory_bytes_gives_proportionally_fewer_blocks(hybrid_path):
    large = _num_blocks(hybrid_path, 8 << 20)
    small = _num_blocks(hybrid_path, 2 << 20)
    assert large == 4 * small


def test_available_memory_without_override_is_measured(hybrid_path):
    config = make_engine_config(hybrid_path, kv_cache_memory_bytes=None, gpu_memory_utilization=0.5)
    executor = UniProcExecutor(config)
    try:
        [available] = executor.determine_available_memory()
        [profile] = executor.collective_rpc(memory_profile)
    finally:
        executor.shutdown()
    assert profile.available_kv_bytes > 0
    # Without kv_cache_memory_bytes a CPU worker takes the measurement, capped by default.
    assert available == min(profile.available_kv_bytes, CPU_DEFAULT_KV_CACHE_BYTES)
    assert profile.budget_bytes == int(host_memory_bytes() * 0.5)
    # RSS before profiling covers at least the interpreter, torch and the weights.
    assert profile.non_torch_bytes > 50 << 20


def test_cpu_profile_runs_a_smaller_step_and_scales_each_stage(hybrid_path):
    # The whole step here: 512 tokens over 64 requests. With a 128-token limit the profile runs
    # 8 requests of 16 tokens, and scales the forward by tokens and the sampler by rows.
    config = make_engine_config(
        hybrid_path, max_model_len=64, max_num_seqs=64, max_num_batched_tokens=512
    )
    executor = UniProcExecutor(config)
    try:
        runner = executor.worker.model_runner
        ran, scales = [], []
        dummy_run = runner._dummy_run

        def recording_dummy_run(query_lens, after_forward=None, rows_per_request=1):
            ran.append((list(query_lens), rows_per_request))
            dummy_run(query_lens, after_forward, rows_per_request)

        runner._dummy_run = recording_dummy_run
        runner.profile_run(128, scales.append)
        runner.profile_run(None, scales.append)
        # Speculative decoding: the LM head and the sampler read a row per draft too.
        runner.speculative_config = SpeculativeConfig(num_speculative_tokens=3)
        runner.profile_run(128, scales.append)
        runner.max_model_len = 8  # no request of the smaller step may be longer
        runner.profile_run(32, scales.append)
    finally:
        executor.shutdown()
    assert ran == [([16] * 8, 1), ([8] * 64, 1), ([16] * 8, 4), ([8] * 4, 4)]
    assert scales == [512 / 128, 64 / 8, 1.0, 1.0, 512 / 128, 64 / 8, 512 / 32, 64 / 4]


def test_bfloat16_kv_cache_with_float32_model(hybrid_path):
    config = make_engine_config(hybrid_path)
    config = dataclasses.replace(
        config, cache_config=dataclasses.replace(config.cache_config, cache_dtype="bfloat16")
    )
    executor = UniProcExecutor(config)
    try:
        [specs] = executor.get_kv_cache_specs()
        assert {spec.dtype for spec in specs.values()} == {torch.bfloat16}
        kv_config = run_kv_cache_handshake(executor)[0]
        [layout] = executor.collective_rpc(kv_cache_layout)
        assert {entry[2] for entry in layout.values()} == {torch.bfloat16}
        request = make_request("bf16", make_prompts(131, [9])[0])
        run_requests(make_scheduler(kv_config), executor_step(executor), {0: [request]})
    finally:
        executor.shutdown()
    assert len(request.output_token_ids) == 5
