"""Workers that misbehave on purpose: `FaultyWorker` raises in `execute_model` when a request
whose prompt starts with `TRIGGER` arrives, so a test can kill a running server's engine at a
moment it picks, with a traceback; `SlowWorker` takes `SLOW_STEP_S` per step, so requests outlive
the server's shutdown grace period."""

from __future__ import annotations

import time

from v1engine.outputs import SchedulerOutput
from v1engine.worker.gpu_worker import Worker

TRIGGER = [13, 13, 13, 13]
FAULT_MESSAGE = "injected fault in execute_model"
SLOW_STEP_S = 0.1


class FaultyWorker(Worker):
    def execute_model(self, scheduler_output: SchedulerOutput):
        for new_request in scheduler_output.scheduled_new_reqs:
            if new_request.prompt_token_ids[: len(TRIGGER)] == TRIGGER:
                raise RuntimeError(FAULT_MESSAGE)
        return super().execute_model(scheduler_output)


class SlowWorker(Worker):
    def execute_model(self, scheduler_output: SchedulerOutput):
        time.sleep(SLOW_STEP_S)
        return super().execute_model(scheduler_output)
