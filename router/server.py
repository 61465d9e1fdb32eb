"""The router process: `tandem router --model PATH --prefill HOST:PORT --decode HOST:PORT`.

Serves tandem.v1.Generate + grpc.health.v1 + reflection. Health: service "" is SERVING only
while the workers can serve a request (readiness); "tandem.v1.Generate" is SERVING while the
process is up (liveness). SIGTERM/SIGINT: health turns
NOT_SERVING and new calls get UNAVAILABLE at once; in-flight streams get
--shutdown-grace-seconds to finish.
"""
from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem.common.logging import get_logger
from tandem.common.metrics import RouterMetrics
from tandem.common.security import BearerTokenInterceptor, TLSFiles, add_port, read_token
from tandem.router.admission import Admission
from tandem.router.ejection import HealthPolicy
from tandem.router.http_server import HTTPServer, TLSPaths
from tandem.router.openai_api import DEFAULT_REQUEST_TIMEOUT_SECONDS, create_app
from tandem.router.request_flow import StallLimits
from tandem.router.routing_policy import RoutingPolicy, add_routing_flags
from tandem.router.servicer import GenerateServicer, add_generate_service
from tandem.router.supervisor import EXIT_MARGIN_SECONDS, Supervisor, default_num_processes
from tandem.router.tokenization import ModelFrontend
from tandem.router.worker_pool import WorkerPool
from tandem.v1 import generate_pb2

logger = get_logger("tandem.router")
SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Generate"].full_name


def _addresses(value: str) -> list[str]:
    return [a.strip() for a in value.split(",") if a.strip()] if value else []


EVENT_LOOPS = ("asyncio", "uvloop")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem router", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF folder (tokenizer, chat template, limits)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    targets = ("comma-separated targets: host:port, dns:///name:port (every address the name "
               "resolves to, re-resolved each health check), or file:///path (host:port lines; "
               "replace the file whole)")
    p.add_argument("--prefill", type=_addresses, default=[], help=f"prefill workers; {targets}")
    p.add_argument("--decode", type=_addresses, default=[], help=f"decode workers; {targets}")
    p.add_argument("--both", type=_addresses, default=[],
                   help=f"aggregated (--role both) workers; {targets}")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--max-concurrency", type=int, default=256)
    p.add_argument("--max-queue", type=int, default=1024)
    p.add_argument("--health-check-interval", type=float, default=1.0,
                   help="seconds between health checks of each worker")
    p.add_argument("--health-check-timeout", type=float, default=5.0,
                   help="seconds a worker has to answer a health check; a slower answer is a "
                        "failed check")
    p.add_argument("--health-failure-threshold", type=int, default=3,
                   help="failed health checks in a row that eject a worker from the pool (an "
                        "unreachable or NOT_SERVING worker, or a failed request, ejects at once)")
    p.add_argument("--ejection-base-seconds", type=float, default=2.0,
                   help="an ejected worker stays out at least this long, then rejoins on a good "
                        "check; doubled for each ejection soon after a rejoin (flapping)")
    p.add_argument("--ejection-max-seconds", type=float, default=60.0,
                   help="the longest ejection; a worker ejected this long after rejoining "
                        "starts again from --ejection-base-seconds")
    p.add_argument("--stall-timeout-seconds", type=float, default=30.0,
                   help="a stream that gets no token for this long ends UNAVAILABLE and its "
                        "worker is ejected (0: off)")
    p.add_argument("--first-token-timeout-seconds", type=float, default=120.0,
                   help="the same for the first token (and the first message from the decode "
                        "worker), plus --first-token-timeout-per-1k-tokens (0: off)")
    p.add_argument("--first-token-timeout-per-1k-tokens", type=float, default=60.0,
                   help="seconds added to --first-token-timeout-seconds per 1000 prompt tokens")
    p.add_argument("--migration-limit", type=int, default=3,
                   help="times a request may move to another worker after its worker fails or "
                        "stalls (a stream continues from the tokens already sent); past it "
                        "the call ends UNAVAILABLE naming every attempt (0: no migration)")
    p.add_argument("--shutdown-grace-seconds", type=float, default=30.0)
    p.add_argument("--tls-cert", help="the router's certificate (PEM); with --tls-key and "
                   "--tls-ca, mutual TLS on the public port and towards the workers")
    p.add_argument("--tls-key", help="private key for --tls-cert (PEM)")
    p.add_argument("--tls-server-name",
                   help="name to expect in peers' certificates (peers are dialled by IP)")
    p.add_argument("--tls-ca", help="CA certificate that signs clients and workers (PEM)")
    p.add_argument("--auth-token-file",
                   help="require 'authorization: Bearer <token>' on tandem.v1.Generate; "
                        "without TLS this needs --internal-token-file too (the router refuses "
                        "to start otherwise: the workers would stay open to anyone)")
    p.add_argument("--internal-token-file",
                   help="the secret the workers were given with their --internal-token-file; "
                        "sent on every call to a worker")
    p.add_argument("--metrics-port", type=int,
                   help="serve Prometheus /metrics on this port (off when not given)")
    p.add_argument("--metrics-host", default="127.0.0.1",
                   help="address for /metrics (0.0.0.0 for a scrape from other hosts)")
    p.add_argument("--http-port", type=int,
                   help="serve the OpenAI-compatible HTTP API (/v1/chat/completions, "
                        "/v1/completions, /v1/models, /health, /version) on this port, beside "
                        "gRPC (off when not given); --auth-token-file guards it too")
    p.add_argument("--http-host",
                   help="address for the HTTP API (default: the same as --host)")
    p.add_argument("--http-request-timeout-seconds", type=float,
                   default=DEFAULT_REQUEST_TIMEOUT_SECONDS,
                   help="deadline of an HTTP completion that sends no X-Request-Timeout "
                        "header (as a gRPC call's deadline: past it the request is aborted "
                        "on every worker and answered 504); 0 means none "
                        f"(default {DEFAULT_REQUEST_TIMEOUT_SECONDS:g})")
    p.add_argument("--processes", type=int, metavar="N",
                   help="router processes sharing --port (and --http-port) through "
                        "SO_REUSEPORT, each with its own worker pool, health checks and share "
                        "of --max-concurrency and --max-queue; a parent restarts any that "
                        "exits and serves their summed metrics on --metrics-port (default: a "
                        "quarter of the cores, at least 1, at most 8)")
    p.add_argument("--process-index", type=int, help=argparse.SUPPRESS)  # set by the parent
    p.add_argument("--drain-delay-seconds", type=float, default=1.0,
                   help="after SIGTERM, report NOT_SERVING (and refuse new calls) this long "
                        "before closing the port, so load balancers stop sending")
    p.add_argument("--event-loop", choices=EVENT_LOOPS, default="asyncio",
                   help="the event loop the router runs on (uvloop: pip install tandem[uvloop])")
    add_routing_flags(p)
    return p


async def serve(args: argparse.Namespace) -> None:
    tls = TLSFiles.from_paths(args.tls_cert, args.tls_key, args.tls_ca,
                              args.tls_server_name)
    if args.http_request_timeout_seconds < 0:
        raise ValueError("--http-request-timeout-seconds must be >= 0 (0: no deadline)")
    token = read_token(args.auth_token_file)
    internal_token = read_token(args.internal_token_file, "--internal-token-file")
    if token and tls is None and internal_token is None:
        raise ValueError("--auth-token-file without TLS needs --internal-token-file (the same "
                         "file the workers get): otherwise anyone reaching a worker port "
                         "bypasses the token")
    health_policy = HealthPolicy(args.health_check_interval, args.health_check_timeout,
                                 args.health_failure_threshold, args.ejection_base_seconds,
                                 args.ejection_max_seconds)
    stall = StallLimits(args.stall_timeout_seconds, args.first_token_timeout_seconds,
                        args.first_token_timeout_per_1k_tokens)
    frontend = await asyncio.to_thread(ModelFrontend, args.model, args.max_model_len)
    metrics = RouterMetrics(frontend.limits.name)
    pool = WorkerPool(args.prefill, args.decode, args.both, health_policy, tls, metrics,
                      internal_token)
    routing = RoutingPolicy(args.routing, args.cache_weight, metrics,
                            args.local_prefill_max_tokens)
    routing.attach(pool)
    await pool.start()
    servicer = GenerateServicer(frontend, pool,
                                Admission(args.max_concurrency, args.max_queue), metrics, stall,
                                args.migration_limit)
    if args.metrics_port is not None:
        metrics.serve(args.metrics_port, args.metrics_host)
        logger.info("metrics on http://%s:%d/metrics", args.metrics_host, args.metrics_port)
    interceptors = [BearerTokenInterceptor(token, (f"/{SERVICE_NAME}/",))] if token else []
    is_one_of_many = args.process_index is not None
    server = grpc.aio.server(interceptors=interceptors,
                             options=[("grpc.so_reuseport", 1)] if is_one_of_many else None)
    add_generate_service(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{args.host}:{args.port}"
    if add_port(server, address, tls) == 0:
        raise SystemExit(f"tandem router: cannot listen on {address}")
    await server.start()
    await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    http_server = None
    if args.http_port is not None:
        http_server = await start_http(servicer, token, args)
    readiness = asyncio.create_task(_track_readiness(pool, health_servicer,
                                                     args.health_check_interval))
    logger.info("router%s serving %s on %s; workers: %s",
                f" process {args.process_index}" if is_one_of_many else "",
                frontend.limits.name, address,
                ", ".join(f"{w.role}={w.address}" for w in pool.workers))

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("shutting down: NOT_SERVING; in-flight streams get %.0f s",
                args.shutdown_grace_seconds)
    servicer.is_draining = True
    readiness.cancel()
    await health_servicer.enter_graceful_shutdown()
    await asyncio.sleep(args.drain_delay_seconds)
    if http_server is not None:
        await asyncio.gather(server.stop(args.shutdown_grace_seconds), http_server.stop())
    else:
        await server.stop(args.shutdown_grace_seconds)
    await routing.close()
    await pool.close()
    frontend.close()
    logger.info("stopped")


async def start_http(servicer: GenerateServicer, token: str | None,
                     args: argparse.Namespace) -> HTTPServer:
    host = args.http_host or args.host
    tls = TLSPaths(args.tls_cert, args.tls_key, args.tls_ca) if args.tls_cert else None
    app = create_app(servicer, token, args.http_request_timeout_seconds or None)
    http_server = HTTPServer(app, host, args.http_port, args.shutdown_grace_seconds, tls,
                             reuse_port=args.process_index is not None)
    await http_server.start()
    logger.info("OpenAI-compatible HTTP API on %s://%s:%d/v1", "https" if tls else "http",
                host, args.http_port)
    return http_server


async def _track_readiness(pool: WorkerPool, health_servicer, interval: float) -> None:
    serving, not_serving = (health_pb2.HealthCheckResponse.SERVING,
                            health_pb2.HealthCheckResponse.NOT_SERVING)
    was_ready = None
    while True:
        is_ready = pool.can_serve
        if is_ready != was_ready:
            await health_servicer.set("", serving if is_ready else not_serving)
            logger.info("router %s", "ready: workers available" if is_ready
                        else "not ready: no complete set of healthy workers")
            was_ready = is_ready
        await asyncio.sleep(min(interval, 0.25))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    try:
        num_processes = (args.processes if args.processes is not None
                         else default_num_processes(args.max_concurrency))
        if num_processes < 1:
            raise ValueError(f"--processes={num_processes} must be >= 1")
        if num_processes > 1:
            return supervise(argv, num_processes, args)
        run = event_loop_runner(args.event_loop)
        run(serve(args))
    except ValueError as exc:
        print(f"tandem router: error: {exc}", file=sys.stderr)
        return 2
    return 0


def event_loop_runner(event_loop: str):
    """asyncio.run, or uvloop.run for --event-loop uvloop (ValueError without the package:
    pip install tandem[uvloop])."""
    if event_loop == "asyncio":
        return asyncio.run
    if event_loop != "uvloop":
        raise ValueError(f"--event-loop={event_loop!r} is not one of {', '.join(EVENT_LOOPS)}")
    try:
        import uvloop
    except ImportError:
        raise ValueError("--event-loop uvloop needs the uvloop package (pip install "
                         "tandem[uvloop])") from None
    return uvloop.run


def supervise(argv: list[str], num_processes: int, args: argparse.Namespace) -> int:
    """`num_processes` routers on one port under a parent that restarts them
    (router/supervisor.py)."""
    if args.port == 0 or args.http_port == 0:
        raise ValueError("--processes above 1 needs a fixed --port (and --http-port): with "
                         "port 0 each process would listen on a port of its own")
    supervisor = Supervisor(argv, num_processes, args.max_concurrency, args.max_queue,
                            args.drain_delay_seconds + args.shutdown_grace_seconds
                            + EXIT_MARGIN_SECONDS, Path(args.model).name)
    if args.metrics_port is not None:
        supervisor.serve_metrics(args.metrics_port, args.metrics_host)
        logger.info("metrics of %d router processes on http://%s:%d/metrics", num_processes,
                    args.metrics_host, args.metrics_port)
    return supervisor.run()


if __name__ == "__main__":
    sys.exit(main())
