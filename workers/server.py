"""The worker process: `tandem worker --role prefill|decode|both --model PATH --port N`.

Loads the model, then serves Worker + KVTransfer + grpc.health.v1 + reflection on one port.
SIGTERM/SIGINT: health turns NOT_SERVING, in-flight calls get `--shutdown-grace-seconds` to
finish, then the engine thread stops.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
from pathlib import Path
from typing import NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem.common.logging import get_logger
from tandem.common.metrics import WorkerMetrics
from tandem.common.security import InternalTokenInterceptor, TLSFiles, add_port, read_token
from tandem.v1 import worker_pb2, worker_pb2_grpc
from tandem.workers.async_engine import AsyncEngine
from tandem.workers.engine.config import EngineConfig
from tandem.workers.engine.model_runner import kv_cache_kind
from tandem.workers.engine.warm_up import warm_up
from tandem.workers.engine_health import EngineHealthWatch
from tandem.common.kv_layout import KVLayout
from tandem.workers.kv.rank_group import RankGroupKV
from tandem.workers.kv.startup import start_kv_transfer
from tandem.workers.kv import nixl_backend
from tandem.workers.kv.transport import KV_TRANSFER_MODES, NIXL, check_kv_transfer
from tandem.workers.metrics_recorder import WorkerMetricsRecorder
from tandem.workers.ops.kernel_options import KernelOptions
from tandem.workers.ops.jit_compiles import JitCompileWatch
from tandem.workers.kv_transfer_service import KVTransferServicer
from tandem.workers.servicer import (KV_PULL_FAILURE_POLICIES, MAX_BLOCK_WAIT_SECONDS, ROLES,
                                     PeerChannels, WorkerServicer)

logger = get_logger("tandem.worker")
SERVICE_NAMES = (worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name,
                 worker_pb2.DESCRIPTOR.services_by_name["KVTransfer"].full_name)
GRPC_OPTIONS = [("grpc.max_send_message_length", 64 << 20),
                ("grpc.max_receive_message_length", 64 << 20),
                ("grpc.so_reuseport", 0)]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem worker", description=__doc__.splitlines()[0])
    p.add_argument("--role", required=True, choices=ROLES)
    p.add_argument("--model", required=True, help="HF checkpoint folder")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--kernels", default="auto",
                   help="auto (aiter-triton on a GPU with amd-aiter installed, else torch) | "
                        "aiter-triton | torch")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs: run every GPU decode and prefill step eagerly")
    p.add_argument("--prefill-graph-tokens", type=int, default=2048,
                   help="a step of one prompt with up to this many new tokens prefills by "
                        "replaying a CUDA graph (one rank, with decode graphs on); 0: every "
                        "prefill eager")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                   help="queue decode step N+1 on the device before reading step N's tokens "
                        "(default: on for a one-rank GPU worker; --async-scheduling also on "
                        "CPU, where it only checks the bookkeeping)")
    p.add_argument("--block-decode", action=argparse.BooleanOptionalAction,
                   help="decode attention of up to 8 sequences by our whole-block CUDA kernel "
                        "on sm_90+ (default: on, unless TANDEM_BLOCK_DECODE=0)")
    p.add_argument("--pdl", action=argparse.BooleanOptionalAction,
                   help="programmatic dependent launch of our decode kernels on Hopper "
                        "(default: on, unless TANDEM_PDL=0)")
    p.add_argument("--one-shot-all-reduce", action=argparse.BooleanOptionalAction,
                   help="small TP all-reduces by our one-shot kernel over CUDA IPC buffers "
                        "(default: on, unless TANDEM_ONE_SHOT_ALL_REDUCE=0)")
    p.add_argument("--kernel-cache", metavar="DIR",
                   help="where our CUDA C++ kernels are built (default: $TANDEM_KERNEL_CACHE, "
                        "else ~/.cache/tandem/kernels)")
    p.add_argument("--skip-warm-up", action="store_true",
                   help="GPU workers run synthetic requests before serving, so kernels compile "
                        "at startup (workers/engine/warm_up.py); this skips it")
    p.add_argument("--load-format", default="auto",
                   help="auto (the checkpoint's safetensors) | dummy (random weights from "
                        "config.json alone, for benchmarks)")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int,
                   help="KV cache blocks (overrides the sizing by --gpu-memory-utilization on "
                        "a GPU, and the 2 GiB default on CPU)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="F",
                   help="fraction of the GPU's memory this worker may use for weights, "
                        "activations, CUDA graphs and KV; the KV cache gets what the rest "
                        "leaves, and memory other processes use must leave room for it")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-lease-seconds", type=float, default=30.0)
    p.add_argument("--kv-transfer", default="auto", choices=KV_TRANSFER_MODES,
                   help="how prompt KV moves between workers: auto (cuda-ipc, GPU to GPU, "
                        "between CUDA workers on one host; else nixl between CUDA workers "
                        "when nixl is installed; else grpc) | grpc | "
                        "cuda-ipc | nixl | mori (required: a handle that cannot use it fails; "
                        "nixl needs the tandem[nixl] extra, and works on CPU caches too; mori, "
                        "untested, needs ROCm and AMD's mori package)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the model over this many processes (one per GPU; this one is "
                        "rank 0 and starts the others)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="with --tensor-parallel-size N: partition the experts over the N "
                        "ranks instead of slicing every expert")
    p.add_argument("--shutdown-grace-seconds", type=float, default=10.0)
    p.add_argument("--kv-pull-failure", choices=KV_PULL_FAILURE_POLICIES, default="recompute",
                   help="when a decode worker cannot pull a prompt's KV (its prefill worker "
                        "is gone, the lease expired, the transfer failed or timed out): "
                        "recompute the prompt here and continue the stream, or fail the "
                        "call UNAVAILABLE (the router then migrates it)")
    p.add_argument("--max-block-wait-seconds", type=float, default=MAX_BLOCK_WAIT_SECONDS,
                   help="decode: how long a prefilled request waits for free KV blocks to "
                        "receive its prompt's KV before RESOURCE_EXHAUSTED (the router then "
                        "tries another decode worker); the prefill worker's pin is renewed "
                        "meanwhile (default %(default)s)")
    p.add_argument("--max-step-stall-seconds", type=float, default=300.0,
                   help="health turns NOT_SERVING while one engine step or command has run "
                        "this long (or the engine thread died). A step is at most one "
                        "--max-num-batched-tokens prefill chunk; on CPU the last 2048-token "
                        "chunk of an 8k prompt takes tens of seconds even for a 135M model, "
                        "hence the default; GPU steps take well under a second")
    p.add_argument("--drain-delay-seconds", type=float, default=0.0,
                   help="after SIGTERM, report NOT_SERVING this long (still serving calls) "
                        "before refusing new ones, so routers stop sending first")
    p.add_argument("--tls-cert", help="this worker's certificate (PEM); with --tls-key and "
                   "--tls-ca turns on mutual TLS for every call in and out")
    p.add_argument("--tls-key", help="private key for --tls-cert (PEM)")
    p.add_argument("--tls-server-name",
                   help="name to expect in peers' certificates (peers are dialled by IP)")
    p.add_argument("--tls-ca", help="CA certificate that signs every Tandem peer (PEM)")
    p.add_argument("--internal-token-file",
                   help="a secret shared by the router and every worker: Worker and KVTransfer "
                        "calls without it get UNAUTHENTICATED, and calls to peer workers send "
                        "it (health and reflection stay open). Without TLS, anyone who reaches "
                        "the port can otherwise run, read and abort requests")
    p.add_argument("--metrics-port", type=int,
                   help="serve Prometheus /metrics on this port (off when not given)")
    p.add_argument("--metrics-host", default="127.0.0.1",
                   help="address for /metrics (0.0.0.0 for a scrape from other hosts)")
    return p


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, kernels=args.kernels,
        max_model_len=args.max_model_len, block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_lease_seconds=args.kv_lease_seconds,
        enable_prefix_caching=not args.no_prefix_caching,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        enforce_eager=args.enforce_eager, prefill_graph_tokens=args.prefill_graph_tokens,
        load_format=args.load_format,
        async_scheduling=args.async_scheduling,
        kernel_options=kernel_options(args))


def kernel_options(args: argparse.Namespace) -> KernelOptions:
    """The environment's kernel options (TANDEM_*), with the flags given overriding them."""
    given = {"block_decode": args.block_decode, "pdl": args.pdl,
             "one_shot_all_reduce": args.one_shot_all_reduce, "kernel_cache": args.kernel_cache}
    return dataclasses.replace(KernelOptions.from_env(),
                               **{name: value for name, value in given.items()
                                  if value is not None})


LOST_FOLLOWER_EXIT_CODE = 3


async def serve(args: argparse.Namespace) -> None:
    from tandem.workers.engine.engine import LLMEngine  # torch import: after arg parsing
    from tandem.workers.executor.executor import build_executor

    config = engine_config(args)
    # Before loading the model: refuse what cannot work whatever "auto" resolves to.
    check_kv_transfer(args.kv_transfer, "cpu" if args.device == "cpu" else "cuda")
    if args.kv_transfer == NIXL and not nixl_backend.is_installed():
        raise ValueError("--kv-transfer nixl needs NIXL: pip install 'tandem[nixl]'")
    tls = TLSFiles.from_paths(args.tls_cert, args.tls_key, args.tls_ca,
                              args.tls_server_name)
    internal_token = read_token(args.internal_token_file, "--internal-token-file")
    metrics = WorkerMetrics(Path(args.model).name, args.role)
    compiles = JitCompileWatch(metrics.record_jit_compile)
    compiles.install()  # logs every Triton compile; warns about those while serving
    executor = await asyncio.to_thread(build_executor, config)
    engine = LLMEngine(config, executor)
    if engine.resolved.device.type == "cuda" and not args.skip_warm_up:
        await asyncio.to_thread(warm_up, engine)  # before the engine thread: one driver
    async_engine = AsyncEngine(engine,
                               on_step=WorkerMetricsRecorder(engine, metrics).after_step)
    try:
        await _serve_engine(args, async_engine, metrics, tls, internal_token, compiles)
    except LostFollowerRank:
        _exit_without_teardown(engine)
    finally:
        compiles.uninstall()
        await async_engine.stop()
        engine.shutdown()  # follower ranks (TP) stop after the engine thread's last step
    logger.info("stopped")


async def _serve_engine(args: argparse.Namespace, async_engine: AsyncEngine,
                        metrics: WorkerMetrics, tls: TLSFiles | None,
                        internal_token: str | None, compiles: JitCompileWatch) -> None:
    engine = async_engine.engine
    model_name = Path(args.model).name
    async_engine.start()
    if args.metrics_port is not None:
        metrics.serve(args.metrics_port, args.metrics_host)
        logger.info("metrics on http://%s:%d/metrics", args.metrics_host, args.metrics_port)
    address = f"{args.host}:{args.port}"
    layout = KVLayout.from_kv_caches(engine.executor.kv_caches, tp_rank=0,
                                     tp_size=engine.executor.tp_size,
                                     kind=kv_cache_kind(engine.model))
    kv = await start_kv_transfer(args.kv_transfer, engine.executor.kv_caches, layout,
                                 RankGroupKV(async_engine, engine.executor.tp_size))
    peers = PeerChannels(tls, internal_token)
    interceptors = ([InternalTokenInterceptor(internal_token,
                                               tuple(f"/{name}/" for name in SERVICE_NAMES))]
                    if internal_token else [])
    if not internal_token and tls is None:
        logger.warning("no --internal-token-file and no TLS: any client that reaches %s can "
                       "call Worker and KVTransfer", address)
    server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=interceptors)
    worker_servicer = WorkerServicer(
        async_engine, args.role, model_name, address, layout, peers, kv.blocks, metrics,
        kv_receiver=kv.receiver, kv_transports=kv.transports,
        cuda_ipc_endpoint=kv.cuda_ipc_exporter.endpoint if kv.cuda_ipc_exporter else None,
        nixl_endpoint=kv.nixl_agent.endpoint if kv.nixl_agent else None,
        connector_endpoints={name: c.endpoint for name, c in kv.connectors.items()},
        kv_pull_failure=args.kv_pull_failure,
        max_block_wait_seconds=args.max_block_wait_seconds)
    worker_pb2_grpc.add_WorkerServicer_to_server(worker_servicer, server)
    worker_pb2_grpc.add_KVTransferServicer_to_server(
        KVTransferServicer(async_engine, layout, kv.blocks, kv.cuda_ipc_exporter,
                           kv.nixl_agent, kv.connectors), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    if add_port(server, address, tls) == 0:
        raise SystemExit(f"tandem worker: cannot listen on {address}")
    await server.start()
    for name in ("", *SERVICE_NAMES):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    engine_watch = EngineHealthWatch(async_engine, health_servicer, ("", *SERVICE_NAMES),
                                     args.max_step_stall_seconds)
    engine_watch.start()
    logger.info("%s worker serving %s on %s (%d Triton compiles at startup)", args.role,
                args.model, address, compiles.num_compiles)
    compiles.mark_serving()

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    lost_follower = asyncio.Event()
    rank_group = engine.executor.rank_group
    if rank_group is not None:  # a dead follower rank leaves the model unusable
        rank_group.followers.watch(lambda: loop.call_soon_threadsafe(
            lambda: (lost_follower.set(), stop.set())))
    await stop.wait()
    logger.info("shutting down: NOT_SERVING, %.0f s grace for in-flight calls",
                args.shutdown_grace_seconds)
    await engine_watch.stop()
    await health_servicer.enter_graceful_shutdown()
    await asyncio.sleep(args.drain_delay_seconds)
    worker_servicer.kv_events.close()  # KV event streams never end on their own
    worker_servicer.close_decode_streams()
    await server.stop(args.shutdown_grace_seconds)
    await peers.close()
    kv.close()
    if lost_follower.is_set():
        raise LostFollowerRank()


class LostFollowerRank(Exception):
    """A follower rank exited while the worker served: the model spans a dead process."""


def _exit_without_teardown(engine) -> None:
    """After a follower died, the other ranks' collectives wait for it forever (NCCL: inside a
    replaying CUDA graph too), so no step, synchronize or process-group teardown can be trusted
    to return. The gRPC server has already stopped; kill the remaining followers and exit now
    (non-zero, for the orchestrator to restart the pod); the OS frees the GPUs."""
    engine.executor.rank_group.followers.kill()
    print("tandem worker: a follower rank exited; stopped the worker", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(LOST_FOLLOWER_EXIT_CODE)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        asyncio.run(serve(args))
    except ValueError as exc:  # bad flags or a bad checkpoint: say which, exit non-zero
        print(f"tandem worker: error: {exc}", file=sys.stderr)
        return 2
    _exit_after_clean_stop()


def _exit_after_clean_stop() -> NoReturn:
    """Exit 0 now that serve() has stopped everything it started (the gRPC server, peer
    channels, the engine thread, follower ranks). Interpreter teardown has nothing left to
    release, yet it walks every object and finalizes torch's and gRPC's extension modules,
    which is slow on a loaded CPU box; orchestrators (`tandem up`, Kubernetes) SIGKILL a
    worker that outlives their grace."""
    logging.shutdown()  # flush every log handler
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
