"""When a request stops: checked after every token the scheduler appends to it."""

from __future__ import annotations

from v1engine.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Finishes `request` if its last output token ends it; returns whether it did.

    Order (the first that applies names the reason): EOS, unless `ignore_eos` or the model has
    no EOS token; one of `stop_token_ids` (recorded as `stop_reason`); `max_tokens`;
    `max_model_len`. The stopping token stays in the output, as in vLLM.
    """
    last_token_id = request.output_token_ids[-1]
    params = request.sampling_params
    eos_token_id = request.eos_token_id
    if not params.ignore_eos and eos_token_id is not None and last_token_id == eos_token_id:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if last_token_id in params.stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last_token_id
        return True
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
