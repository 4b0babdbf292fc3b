"""Token-level stop conditions, checked after every sampled token."""

from __future__ import annotations

from engine.core.request import Request, RequestStatus


def check_token_stop(request: Request, max_model_len: int) -> RequestStatus | None:
    """The finished status the newest token puts the request in, or None to keep going."""
    params = request.sampling_params
    token_id = request.output_token_ids[-1]
    num_outputs = len(request.output_token_ids)  # per token: no property hop
    if num_outputs >= params.min_tokens:
        if token_id == request.eos_token_id and not params.ignore_eos:
            request.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_set:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
    if (num_outputs >= request.max_tokens
            or len(request.prompt_token_ids) + num_outputs >= max_model_len):
        return RequestStatus.FINISHED_LENGTH
    return None
