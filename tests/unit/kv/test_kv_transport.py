"""--kv-transfer: flag validation, what a prefill worker offers, what a decode worker picks,
the handle's fields, and the stacked cache view the cuda-ipc copy relies on (CPU only)."""
from __future__ import annotations

import pytest
import torch

from tandem.v1 import worker_pb2
from tandem.workers.kv import transport
from tandem.workers.kv.cuda_ipc import flat_caches, host_id, stacked_view
from tandem.workers.kv.transport import (CUDA_IPC, GRPC, NIXL, KVTransportUnavailable,
                                         check_kv_transfer, choose_transport, nixl_wanted,
                                         offered_transports)
from tandem.workers.server import build_parser

HOST = "h/boot"


def test_flag_choices_and_default():
    parser = build_parser()
    base = ["--role", "decode", "--model", "m", "--port", "1"]
    assert parser.parse_args(base).kv_transfer == "auto"
    for mode in transport.KV_TRANSFER_MODES:
        assert parser.parse_args([*base, "--kv-transfer", mode]).kv_transfer == mode
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--kv-transfer", "nccl"])


@pytest.mark.parametrize("mode,device,error", [
    ("auto", "cpu", None), ("auto", "cuda", None), ("grpc", "cpu", None),
    ("cuda-ipc", "cuda", None), ("cuda-ipc", "cpu", "CUDA device"),
    ("rdma", "cuda", "not one of"), ("nixl", "cpu", None), ("nixl", "cuda", None)])
def test_check_kv_transfer(mode, device, error):
    """Every mode works at any TP size (TP workers hand off rank to rank: ipc_ranks.py,
    nixl_ranks.py), so only the device and the mode's name can be refused."""
    if error is None:
        check_kv_transfer(mode, device)
    else:
        with pytest.raises(ValueError, match=error):
            check_kv_transfer(mode, device)


def test_offered_transports():
    assert offered_transports("auto", "cuda") == [CUDA_IPC, GRPC]
    assert offered_transports("cuda-ipc", "cuda") == [CUDA_IPC, GRPC]
    assert offered_transports("grpc", "cuda") == [GRPC]
    assert offered_transports("auto", "cpu") == [GRPC]
    assert offered_transports("auto", "cuda", nixl_ready=True) == [CUDA_IPC, NIXL, GRPC]
    assert offered_transports("nixl", "cuda", nixl_ready=True) == [NIXL, GRPC]
    assert offered_transports("nixl", "cpu", nixl_ready=True) == [NIXL, GRPC]
    assert offered_transports("grpc", "cuda", nixl_ready=True) == [GRPC]
    assert offered_transports("cuda-ipc", "cuda", nixl_ready=True) == [CUDA_IPC, GRPC]


@pytest.mark.parametrize("mode,device,installed,wanted", [
    ("nixl", "cpu", True, True), ("nixl", "cuda", False, True),  # start-up says why
    ("auto", "cuda", True, True), ("auto", "cuda", False, False),
    ("auto", "cpu", True, False),  # CPU workers stay on grpc unless nixl is asked for
    ("grpc", "cuda", True, False), ("cuda-ipc", "cuda", True, False)])
def test_nixl_wanted(mode, device, installed, wanted):
    assert nixl_wanted(mode, device, installed) is wanted


def test_choose_transport_order_is_cuda_ipc_then_nixl_then_grpc():
    every = [CUDA_IPC, NIXL, GRPC]
    assert choose_transport("auto", every, HOST, HOST, "cuda", nixl_ready=True)[0] == \
        CUDA_IPC
    backend, why = choose_transport("auto", every, "other/boot", HOST, "cuda",
                                    nixl_ready=True)
    assert backend == NIXL and "another host" in why
    backend, why = choose_transport("auto", every, "other/boot", HOST, "cuda")
    assert backend == GRPC and "another host" in why and "no NIXL agent" in why
    backend, why = choose_transport("auto", [CUDA_IPC, GRPC], "other/boot", HOST, "cuda",
                                    nixl_ready=True)
    assert backend == GRPC and "does not offer nixl" in why
    assert choose_transport("grpc", every, "o", HOST, "cuda", nixl_ready=True)[0] == GRPC
    # cuda-ipc mode never takes nixl
    with pytest.raises(KVTransportUnavailable, match="another host"):
        choose_transport("cuda-ipc", every, "other/boot", HOST, "cuda", nixl_ready=True)


def test_nixl_mode_requires_nixl_even_on_one_host():
    every = [CUDA_IPC, NIXL, GRPC]
    assert choose_transport("nixl", every, HOST, HOST, "cuda", nixl_ready=True) == \
        (NIXL, "--kv-transfer nixl")
    assert choose_transport("nixl", [NIXL], "", HOST, "cpu", nixl_ready=True)[0] == NIXL
    with pytest.raises(KVTransportUnavailable, match="--kv-transfer nixl: the source does "
                                                     "not offer nixl"):
        choose_transport("nixl", [CUDA_IPC, GRPC], HOST, HOST, "cuda", nixl_ready=True)
    with pytest.raises(KVTransportUnavailable, match="no NIXL agent"):
        choose_transport("nixl", every, HOST, HOST, "cpu")


def test_handle_carries_the_nixl_endpoint_in_field_10():
    handle = worker_pb2.KVHandle(handle_id="r", transports=[NIXL, GRPC],
                                 nixl=worker_pb2.NixlEndpoint(agent_name="a", export_id="e"))
    assert worker_pb2.KVHandle.DESCRIPTOR.fields_by_name["nixl"].number == 10
    again = worker_pb2.KVHandle.FromString(handle.SerializeToString())
    assert again.nixl.agent_name == "a" and again.nixl.export_id == "e"
    assert not worker_pb2.KVHandle(handle_id="old").HasField("nixl")


def test_importing_the_workers_does_not_import_nixl():
    """nixl loads only when a worker creates an agent (a fresh interpreter checks it)."""
    import subprocess
    import sys

    code = ("import sys, tandem.workers.server, tandem.workers.kv.nixl_backend, "
            "tandem.bench.kv_transfer; "
            "print(sorted(m for m in sys.modules if m.split('.')[0].startswith('nixl')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_choose_transport_prefers_cuda_ipc_on_one_host():
    both = [CUDA_IPC, GRPC]
    assert choose_transport("auto", both, HOST, HOST, "cuda")[0] == CUDA_IPC
    assert choose_transport("cuda-ipc", both, HOST, HOST, "cuda")[0] == CUDA_IPC
    assert choose_transport("grpc", both, HOST, HOST, "cuda") == (GRPC, "--kv-transfer grpc")


@pytest.mark.parametrize("transports,source_host,device,why", [
    ([GRPC], HOST, "cuda", "does not offer cuda-ipc"),
    ([], HOST, "cuda", "does not offer cuda-ipc"),  # an old handle: grpc only
    ([CUDA_IPC, GRPC], "other/boot", "cuda", "another host"),
    ([CUDA_IPC, GRPC], "", "cuda", "another host"),
    ([CUDA_IPC, GRPC], HOST, "cpu", "not on a CUDA device")])
def test_choose_transport_falls_back_or_refuses(transports, source_host, device, why):
    backend, reason = choose_transport("auto", transports, source_host, HOST, device)
    assert backend == GRPC and why in reason
    with pytest.raises(KVTransportUnavailable, match=why):
        choose_transport("cuda-ipc", transports, source_host, HOST, device)


def test_no_common_backend_is_refused():
    with pytest.raises(KVTransportUnavailable, match="no common"):
        choose_transport("auto", [CUDA_IPC], "other/boot", HOST, "cuda")


def test_handle_carries_transports_and_endpoint():
    endpoint = worker_pb2.CudaIpcEndpoint(host_id=host_id(), device_uuid="GPU-x",
                                          export_id="e1")
    handle = worker_pb2.KVHandle(handle_id="r", backend="grpc", transports=[CUDA_IPC, GRPC],
                                 cuda_ipc=endpoint)
    again = worker_pb2.KVHandle.FromString(handle.SerializeToString())
    assert list(again.transports) == [CUDA_IPC, GRPC]
    assert again.cuda_ipc.host_id == host_id() and again.cuda_ipc.export_id == "e1"
    assert not worker_pb2.KVHandle(handle_id="old").HasField("cuda_ipc")


def test_host_id_is_stable():
    assert host_id() == host_id() and "/" in host_id()


def test_stacked_view_of_runner_style_caches():
    stack = torch.arange(4 * 3 * 2 * 5, dtype=torch.float32).reshape(4, 3, 2, 5)
    caches = [(stack[0], stack[1]), (stack[2], stack[3])]
    flat = flat_caches(caches)
    view = stacked_view(flat)
    assert view is not None and view.data_ptr() == stack.data_ptr()
    assert torch.equal(view, stack)
    ids_src, ids_dst = torch.tensor([2, 0]), torch.tensor([1, 2])
    dst = torch.zeros_like(stack)
    dst.index_copy_(1, ids_dst, view.index_select(1, ids_src))
    for i, t in enumerate(flat):
        assert torch.equal(dst[i][ids_dst], t[ids_src])


def test_stacked_view_of_block_major_caches():
    """The runner's layout: [blocks, tensors, block] with tensor t = stack[:, t]."""
    stack = torch.arange(5 * 4 * 2 * 3, dtype=torch.float32).reshape(5, 4, 2, 3)
    flat = flat_caches([(stack[:, 0], stack[:, 1]), (stack[:, 2], stack[:, 3])])
    view = stacked_view(flat)
    assert view is not None and view.data_ptr() == stack.data_ptr()
    assert torch.equal(view, stack.transpose(0, 1))
    assert stacked_view([stack[:, 0], stack[:, 2]]) is not None  # every other tensor: fits
    assert stacked_view([stack[:, 0], stack[:, 2], stack[:, 4 - 1]]) is None  # uneven


def test_stacked_view_refuses_separate_tensors():
    separate = [torch.zeros(3, 2), torch.zeros(3, 2)]
    assert stacked_view(separate) is None
    base = torch.zeros(4, 3, 2)
    assert stacked_view([base[0], base[2], base[3]]) is None  # not equally spaced
