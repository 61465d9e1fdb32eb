"""The control channel's headers (workers/parallel/messages.py): a follower sizes every payload
from the header alone, so each command that sends one must say how long it is."""
from __future__ import annotations

import torch

from tandem.workers.parallel.messages import (Command, make_header, pack_bytes, packed_length,
                                              payload_length, unpack_bytes)


def test_payload_lengths_come_from_the_headers():
    sizes = [1, 2, 4, 8, 16]
    assert payload_length(make_header(Command.CAPTURE_GRAPHS, 4096, len(sizes))) == 5
    # a STEP of KV rank ops alone: 17 bytes in 3 int64s
    assert payload_length(make_header(Command.STEP, 0, 0, 0, 0, 0, 0, 17)) == 3
    for command in (Command.STOP, Command.KV_BLOCKS):
        assert payload_length(make_header(command, 9)) == 0


def test_bytes_survive_packing():
    for data in (b"", b"a", bytes(range(8)), bytes(range(256)) * 3):
        packed = pack_bytes(data)
        assert packed.dtype == torch.int64 and packed.numel() == packed_length(len(data))
        assert unpack_bytes(packed, len(data)) == data


def test_step_payload_length_matches_its_parts():
    num_tokens, num_seqs, max_blocks, num_logits = 11, 3, 16, 3
    header = make_header(Command.STEP, num_tokens, num_seqs, max_blocks, num_logits, 9, 40)
    parts = [num_tokens] * 3 + [num_seqs + 1, num_seqs, num_seqs * max_blocks, num_logits]
    assert payload_length(header) == sum(parts)
    assert header.dtype == torch.int64 and int(header[0]) == Command.STEP
    with_ops = make_header(Command.STEP, num_tokens, num_seqs, max_blocks, num_logits, 9, 40, 9)
    assert payload_length(with_ops) == sum(parts) + 2  # the KV rank ops' 9 bytes follow


def test_a_command_travels_as_one_message_when_its_payload_fits():
    from tandem.workers.parallel.messages import (INLINE_PAYLOAD, MESSAGE_LEN, frame_command,
                                                  split_message)

    for length in (0, 5, INLINE_PAYLOAD, INLINE_PAYLOAD + 3):
        header = make_header(Command.CAPTURE_GRAPHS, 4096, length)
        payload = torch.arange(length, dtype=torch.int64) + 100
        message, rest = frame_command(header, payload)
        assert message.shape == (MESSAGE_LEN,)
        got_header, inline, still_to_come = split_message(message)
        assert torch.equal(got_header, header)
        assert still_to_come == (0 if rest is None else rest.numel())
        whole = inline if rest is None else torch.cat([inline, rest])
        assert torch.equal(whole, payload)
        assert (rest is None) == (length <= INLINE_PAYLOAD)
