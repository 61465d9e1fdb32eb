"""The control channel's headers (workers/parallel/messages.py): a follower sizes every payload
from the header alone, so each command that sends one must say how long it is."""
from __future__ import annotations

import torch

from tandem.workers.parallel.messages import Command, make_header, payload_length


def test_payload_lengths_come_from_the_headers():
    assert payload_length(make_header(Command.GATHER_KV, 7)) == 7
    assert payload_length(make_header(Command.SCATTER_KV, 3)) == 3
    for command in (Command.STOP, Command.KV_BLOCKS):
        assert payload_length(make_header(command, 9)) == 0


def test_step_payload_length_matches_its_parts():
    num_tokens, num_seqs, max_blocks, num_logits = 11, 3, 16, 3
    header = make_header(Command.STEP, num_tokens, num_seqs, max_blocks, num_logits, 9, 40)
    parts = [num_tokens] * 3 + [num_seqs + 1, num_seqs, num_seqs * max_blocks, num_logits]
    assert payload_length(header) == sum(parts)
    assert header.dtype == torch.int64 and int(header[0]) == Command.STEP
