"""A model step's inputs as the STEP command carries them to the follower ranks: int64 values
on the host (parallel/messages.py frames them; its docstring gives the payload's layout),
followed by the step's KV rank ops, if any (opaque bytes: kv/rank_ops.py)."""
from __future__ import annotations

import itertools

import torch

from tandem.workers.engine.model_runner import ModelInputs
from tandem.workers.engine.packed_inputs import INPUT_HEADER, input_header
from tandem.workers.ops.attention import AttentionMetadata
from tandem.workers.parallel.messages import (Command, make_header, pack_bytes,
                                              step_inputs_length, unpack_bytes)


def pack_inputs(inputs: ModelInputs, kv_ops: bytes = b"") -> tuple[torch.Tensor, torch.Tensor]:
    """ModelInputs (and the step's encoded KV rank ops) -> (header, payload), both int64 on
    the host."""
    meta = inputs.meta
    num_tokens = inputs.input_ids.numel()
    num_seqs, max_blocks = meta.block_tables.shape
    parts = [inputs.input_ids, inputs.positions, meta.slot_mapping, meta.query_start_loc,
             meta.seq_lens, meta.block_tables.reshape(-1), inputs.logits_indices]
    if kv_ops:
        parts.append(pack_bytes(kv_ops))
    payload = torch.cat([part.to(device="cpu", dtype=torch.int64) for part in parts])
    header = make_header(Command.STEP, num_tokens, num_seqs, max_blocks,
                         inputs.logits_indices.numel(), meta.max_query_len, meta.max_seq_len,
                         len(kv_ops))
    return header, payload


def pack_kv_ops(kv_ops: bytes) -> tuple[torch.Tensor, torch.Tensor]:
    """A step of KV rank ops alone (no model inputs) -> (header, payload)."""
    return make_header(Command.STEP, 0, 0, 0, 0, 0, 0, len(kv_ops)), pack_bytes(kv_ops)


def has_model_inputs(header: torch.Tensor) -> bool:
    return step_inputs_length(header) > 0


def unpack_kv_ops(header: torch.Tensor, payload: torch.Tensor) -> bytes:
    """The step's encoded KV rank ops (b"": none)."""
    num_bytes = int(header[7])
    if not num_bytes:
        return b""
    return unpack_bytes(payload[step_inputs_length(header):], num_bytes)


def unpack_inputs(header: torch.Tensor, payload: torch.Tensor,
                  device: torch.device) -> ModelInputs:
    """The inverse of `pack_inputs`, with tensors on `device` in the dtypes the runner uses
    (one host-to-device copy of the whole payload after its packed_inputs header; the parts
    are views of it, as the leader's are)."""
    num_tokens, num_seqs, max_blocks, num_logits, max_query_len, max_seq_len = \
        header[1:7].tolist()
    sizes = [num_tokens, num_tokens, num_tokens, num_seqs + 1, num_seqs,
             num_seqs * max_blocks, num_logits]
    payload = payload[:sum(sizes)]  # the KV rank ops, if any, follow
    starts = list(itertools.accumulate(sizes[:-1], initial=INPUT_HEADER))
    layout = torch.tensor(input_header(num_seqs, max_blocks, starts), dtype=torch.int64)
    packed = torch.cat([layout, payload]).to(device)
    (input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_tables,
     logits_indices) = packed[INPUT_HEADER:].split(sizes)
    host_query_start_loc, host_seq_lens = payload.split(sizes)[3:5]
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc.to(torch.int32),
        seq_lens=seq_lens.to(torch.int32),
        block_tables=block_tables.view(num_seqs, max_blocks).to(torch.int32),
        max_query_len=max_query_len, max_seq_len=max_seq_len,
        query_start_loc_host=host_query_start_loc.tolist(),
        seq_lens_host=host_seq_lens.tolist())
    return ModelInputs(input_ids, positions, meta, logits_indices, packed)
