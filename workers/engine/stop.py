"""When a sequence is done, given the token it just sampled."""
from __future__ import annotations

from tandem.workers.engine.sequence import FinishReason, Sequence


def check_stop(seq: Sequence, eos_token_ids: frozenset[int], max_model_len: int
               ) -> FinishReason | None:
    """Checked after every token whose id reaches the host, on the sequence up to that token (a
    later token may already be in flight: Sequence.num_inflight_tokens). min_tokens is enforced
    by the sampler, which masks stop tokens until it is reached; this check respects it too."""
    params = seq.sampling_params
    last = seq.last_known_token_id
    num_tokens = seq.num_known_tokens
    num_completion = num_tokens - seq.num_prompt_tokens
    if num_completion >= params.min_tokens:
        if last in params.stop_token_ids or (not params.ignore_eos and last in eos_token_ids):
            return FinishReason.STOP
    if num_completion >= params.max_tokens or num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None
