"""glibc malloc tuning: after it, a step's large tensors reuse heap memory instead of faulting in
fresh pages every time."""

from __future__ import annotations

import platform
import resource

import pytest
import torch

from v1engine.worker.cpu_malloc import tune_malloc_for_tensors

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")


def _page_faults_allocating(num_bytes: int, times: int) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(times):
        tensor = torch.empty(num_bytes, dtype=torch.uint8)
        tensor.fill_(1)  # touch every page, as a kernel writing its output does
        del tensor
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_repeated_large_tensors_stop_page_faulting():
    num_bytes, times = 16 << 20, 20
    pages = num_bytes // resource.getpagesize()
    assert tune_malloc_for_tensors()
    # The heap grows to hold the tensor; in a fresh process glibc took a few rounds to settle.
    _page_faults_allocating(num_bytes, 10)
    faults = _page_faults_allocating(num_bytes, times)
    # Without the tuning every allocation maps fresh pages: about times * pages faults.
    assert faults < pages, f"{faults} page faults for {times} reused 16 MiB tensors"
