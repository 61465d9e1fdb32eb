"""What rank 0 tells its follower ranks, as int64 tensors (no pickling).

Every command is a fixed-size header and, for some commands, an int64 payload whose length the
header gives:

    header [HEADER_LEN] int64 = [command, arg0, arg1, ...] (unused args are 0)

Rank 0 broadcasts them on the control group as one fixed-size message, [header | the first
INLINE_PAYLOAD payload values, zero-padded], then the payload values past those, if any, as a
second broadcast (`frame_command` / `receive_command` in executor/rank_runner.py). A decode step's
inputs fit the first message, so a step costs one broadcast (two cost ~2x as long over gloo).
Commands:

    STEP       args (T, B, M, N, max_query_len, max_seq_len, K); payload = the ModelInputs
               packed as input_ids[T] positions[T] slot_mapping[T] query_start_loc[B+1]
               seq_lens[B] block_tables[B*M] logits_indices[N] (executor/step_inputs.py), then
               K bytes of KV rank ops (pack_bytes) that every rank runs before the model
               (kv/rank_ops.py: opaque here). A step of ops alone has T = B = 0.
    STOP       no args: followers leave their loop and exit
    PROFILE_MEMORY args (uses_cuda_graphs,): sent once after loading, on GPUs unless
               num_kv_blocks is given: every rank profiles a dummy prefill together and sizes
               its own KV cache (engine/memory_profile.py); all learn every rank's block count
               (0: that rank's cache does not fit), and KV_BLOCKS follows with the smallest
    KV_BLOCKS  args (num_kv_blocks,): sent once after loading (after PROFILE_MEMORY, if sent),
               so every rank allocates as many blocks as rank 0
    CAPTURE_GRAPHS args (max_model_len, n); payload = n decode batch sizes: every rank captures
               its decode CUDA graphs (ModelRunner.enable_cuda_graphs) at once, so the NCCL
               collectives of their warm-up passes and captures pair up
"""
from __future__ import annotations

from enum import IntEnum

import torch


HEADER_LEN = 8
INLINE_PAYLOAD = 8184  # payload values in a command's first message (64 KiB in all)
MESSAGE_LEN = HEADER_LEN + INLINE_PAYLOAD


class Command(IntEnum):
    STEP = 1
    STOP = 4
    KV_BLOCKS = 5
    CAPTURE_GRAPHS = 9
    PROFILE_MEMORY = 16


def make_header(command: Command, *args: int) -> torch.Tensor:
    if len(args) > HEADER_LEN - 1:
        raise ValueError(f"{command.name}: {len(args)} args do not fit a {HEADER_LEN}-long header")
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0] = int(command)
    header[1:1 + len(args)] = torch.tensor(args, dtype=torch.int64)
    return header


def payload_length(header: torch.Tensor) -> int:
    """How many int64 values follow a header (0 for commands without a payload)."""
    command = Command(int(header[0]))
    if command is Command.STEP:
        return step_inputs_length(header) + packed_length(int(header[7]))
    if command is Command.CAPTURE_GRAPHS:
        return int(header[2])
    return 0


def step_inputs_length(header: torch.Tensor) -> int:
    """How many of a STEP's payload values are model inputs (the KV rank ops follow them)."""
    num_tokens, num_seqs, max_blocks, num_logits = header[1:5].tolist()
    if num_tokens == 0 and num_seqs == 0:
        return 0  # a step of KV rank ops alone
    return 3 * num_tokens + (num_seqs + 1) + num_seqs + num_seqs * max_blocks + num_logits


def frame_command(header: torch.Tensor, payload: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the first message [MESSAGE_LEN], the payload values that did not fit it or None)."""
    message = torch.zeros(MESSAGE_LEN, dtype=torch.int64)
    message[:HEADER_LEN] = header
    if payload is None or not payload.numel():
        return message, None
    inline = min(payload.numel(), INLINE_PAYLOAD)
    message[HEADER_LEN:HEADER_LEN + inline] = payload[:inline]
    return message, (payload[inline:].contiguous() if payload.numel() > inline else None)


def split_message(message: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A first message -> (header, its inline payload values, payload values still to come)."""
    header = message[:HEADER_LEN]
    length = payload_length(header)
    inline = min(length, INLINE_PAYLOAD)
    return header, message[HEADER_LEN:HEADER_LEN + inline], length - inline


def packed_length(num_bytes: int) -> int:
    """int64 values that hold num_bytes bytes (pack_bytes)."""
    return -(-num_bytes // 8)


def pack_bytes(data: bytes) -> torch.Tensor:
    """Bytes -> int64 values (zero-padded to a multiple of 8 bytes); unpack_bytes inverts."""
    padded = data + bytes(packed_length(len(data)) * 8 - len(data))
    return torch.frombuffer(bytearray(padded), dtype=torch.int64) if padded else \
        torch.empty(0, dtype=torch.int64)


def unpack_bytes(values: torch.Tensor, num_bytes: int) -> bytes:
    return values.contiguous().view(torch.uint8).numpy().tobytes()[:num_bytes]
