"""A KV source whose pulls hang: a decode worker pulling from it keeps the blocks it reserved
for the pull until the test lets go.

    with hanging_kv_source() as source:
        handle.source_address = source.address   # a KVHandle whose pull is to hang
        ...
        source.release.set()                     # the pulls fail UNAVAILABLE from now on
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import grpc

from tandem.v1 import worker_pb2_grpc


class HangingKVSource(worker_pb2_grpc.KVTransferServicer):
    def __init__(self) -> None:
        self.release = threading.Event()
        self.address = ""

    def PullKV(self, request, context):  # noqa: N802 (gRPC's naming)
        self.release.wait(120)
        context.abort(grpc.StatusCode.UNAVAILABLE, "hanging source released")


@contextmanager
def hanging_kv_source() -> Iterator[HangingKVSource]:
    """A HangingKVSource served on 127.0.0.1; released and stopped on exit."""
    source = HangingKVSource()
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    worker_pb2_grpc.add_KVTransferServicer_to_server(source, server)
    source.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    try:
        yield source
    finally:
        source.release.set()
        server.stop(0)
