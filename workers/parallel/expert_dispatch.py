"""Expert parallelism's seam: send tokens to the ranks that hold their experts, and back.

    dispatched = dispatcher.dispatch(hidden, topk_ids, topk_weights)
    expert_out = <this rank's experts over dispatched.hidden>  # [R, H], routing weights applied
    hidden_out = dispatcher.combine(expert_out, dispatched)    # [T, H], every token's sum

The shape follows MORI-EP's (and DeepEP's) dispatch/combine: a token travels once to each
rank holding at least one of its top-k experts, with its full top-k ids and weights (global
expert ids); the receiving rank runs only its own experts on it; combine returns each
partial result to the token's rank and sums them there. A MORI-EP backend implements the
same two methods over its shared-memory/RDMA buffers.

`AllToAllDispatcher` is the torch.distributed backend (all_to_all_single: NCCL on GPUs, gloo
on CPU). Activations are replicated across a worker's TP ranks, so before dispatching each
rank takes its own contiguous 1/N of the tokens (rank r: tokens [r*c, (r+1)*c), c = ceil(T/N)),
and after combining the ranks all-gather those chunks, so every rank again holds all T rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist


@dataclass(slots=True)
class DispatchedTokens:
    """What one rank received: R tokens, each once, with their full routing."""

    hidden: torch.Tensor  # [R, H]
    topk_ids: torch.Tensor  # [R, k] global expert ids (some live on other ranks)
    topk_weights: torch.Tensor  # [R, k] fp32
    # Bookkeeping for combine: the rows this rank sent, as indices into its own token chunk,
    # grouped by destination rank (send_counts[d] rows for rank d, in rank order).
    sent_rows: torch.Tensor  # [S] int64
    send_counts: list[int]
    recv_counts: list[int]
    num_tokens: int  # T: tokens of the whole step (all ranks' chunks)


class ExpertDispatcher(Protocol):
    def dispatch(self, hidden: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> DispatchedTokens: ...

    def combine(self, expert_output: torch.Tensor,
                dispatched: DispatchedTokens) -> torch.Tensor: ...


class AllToAllDispatcher:
    """torch.distributed all-to-all over the worker's default group (see module doc)."""

    def __init__(self, num_experts: int, ep_rank: int, ep_size: int) -> None:
        if num_experts % ep_size:
            raise ValueError(f"{num_experts} experts do not split across {ep_size} ranks")
        self.experts_per_rank = num_experts // ep_size
        self.ep_rank, self.ep_size = ep_rank, ep_size

    def _own_chunk(self, num_tokens: int) -> tuple[int, int, int]:
        """(chunk size c, first, end) of this rank's tokens."""
        chunk = -(-num_tokens // self.ep_size)
        first = min(self.ep_rank * chunk, num_tokens)
        return chunk, first, min(first + chunk, num_tokens)

    def dispatch(self, hidden: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> DispatchedTokens:
        num_tokens, top_k = topk_ids.shape
        _, first, end = self._own_chunk(num_tokens)
        own_ids = topk_ids[first:end]  # [t, k]
        destination = own_ids // self.experts_per_rank  # [t, k] rank of each chosen expert
        goes_to = torch.zeros(end - first, self.ep_size, dtype=torch.bool, device=hidden.device)
        goes_to.scatter_(1, destination, True)  # [t, N]: token needs rank d
        _, sent_rows = goes_to.t().nonzero(as_tuple=True)  # grouped by rank, then token order
        send_counts = goes_to.sum(0)  # [N]
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        # ids travel as fp32 beside the weights: exact for fewer than 2**24 experts.
        meta = torch.cat([own_ids[sent_rows].float(), topk_weights[first:end][sent_rows].float()],
                         dim=1)  # [S, 2k]
        hidden_in = hidden.new_empty((sum(recv), hidden.shape[1]))
        meta_in = meta.new_empty((sum(recv), 2 * top_k))
        dist.all_to_all_single(hidden_in, hidden[first:end][sent_rows].contiguous(), recv, send)
        dist.all_to_all_single(meta_in, meta, recv, send)
        return DispatchedTokens(hidden_in, meta_in[:, :top_k].long(), meta_in[:, top_k:],
                                sent_rows, send, recv, num_tokens)

    def combine(self, expert_output: torch.Tensor,
                dispatched: DispatchedTokens) -> torch.Tensor:
        chunk, first, end = self._own_chunk(dispatched.num_tokens)
        returned = expert_output.new_empty((sum(dispatched.send_counts), expert_output.shape[1]))
        dist.all_to_all_single(returned, expert_output.contiguous(), dispatched.send_counts,
                               dispatched.recv_counts)
        # Partial sums arrive in rank order, i.e. in ascending expert-id ranges.
        own = expert_output.new_zeros((chunk, expert_output.shape[1]))
        own.index_add_(0, dispatched.sent_rows, returned)
        chunks = [torch.empty_like(own) for _ in range(self.ep_size)]
        dist.all_gather(chunks, own)
        return torch.cat(chunks)[:dispatched.num_tokens]


def make_dispatcher(num_experts: int, ep_rank: int, ep_size: int) -> ExpertDispatcher:
    """The dispatcher expert-parallel layers use (the torch.distributed one, for now)."""
    return AllToAllDispatcher(num_experts, ep_rank, ep_size)
