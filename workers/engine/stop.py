"""When a sequence is done, given the token it just sampled."""
from __future__ import annotations

from tandem.workers.engine.sequence import FinishReason, Sequence


def check_stop(seq: Sequence, eos_token_ids: frozenset[int], max_model_len: int
               ) -> FinishReason | None:
    """Checked after every appended token. min_tokens is enforced by the sampler, which masks
    stop tokens until it is reached; this check respects it too."""
    params = seq.sampling_params
    last = seq.token_ids[-1]
    if seq.num_completion_tokens >= params.min_tokens:
        if last in params.stop_token_ids or (not params.ignore_eos and last in eos_token_ids):
            return FinishReason.STOP
    if seq.num_completion_tokens >= params.max_tokens or seq.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None
