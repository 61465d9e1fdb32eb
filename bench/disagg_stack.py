"""Processes and models for bench/disagg.py: one router + its workers as real subprocesses.

A LocalStack starts its workers (each pinned to one device) and the router together (the
router loads its tokenizer while the workers load the model), waits until every worker and then
the router report SERVING on grpc.health.v1, and then until the router's /metrics says every
worker is in its pool, so requests spread over all of them from the first one. Every child
writes its output to `<log_dir>/<name>.log` and leads its own session, so a Ctrl-C in the
terminal reaches only the benchmark, which then stops the router first and the workers after
it (SIGTERM, a grace period, then SIGKILL of the child's whole process group). A GPU worker
for "cuda:N" is started with CUDA_VISIBLE_DEVICES=N and `--device cuda`, so inside it the GPU
is device 0: kernels, streams and CUDA graphs never meet a second device.

Models: `write_tokenizer` writes a small byte-level tokenizer (259 ids) next to a config.json,
because the router always loads a tokenizer; the benchmark sends token-id prompts, so the
router tokenizes nothing, and the ids the model emits beyond the tokenizer's vocabulary
detokenize to no text (the token ids still stream and are what the benchmark counts).
`build_tiny_checkpoint` makes the CPU smoke model with transformers (random weights, saved
with save_pretrained).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.bench.proc_stats import process_cpu_seconds, tree_cpu_seconds
from tandem.common.ports import free_port

__all__ = ["LocalStack", "StackFailure", "build_tiny_checkpoint", "write_tokenizer"]
POLL_S = 0.2
HEALTH_INTERVAL_S = 0.5  # the router's worker health checks


class StackFailure(RuntimeError):
    """A child exited or was not SERVING in time; the message has its last log lines."""


@dataclass(slots=True)
class _Child:
    name: str
    address: str
    proc: subprocess.Popen
    log_path: Path

    def tail(self, num_lines: int = 25) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()[-num_lines:]
        except OSError:
            lines = []
        return "\n".join(f"    {line}" for line in lines) or "    (no output)"


@dataclass
class LocalStack:
    """One layout: `workers` are (role, device) pairs; the router gets their addresses by role.

    `worker_args` go to every worker, `router_args` to the router; `env` is added to every
    child's environment (e.g. OMP_NUM_THREADS for CPU runs)."""
    name: str
    model: Path
    workers: list[tuple[str, str]]
    log_dir: Path
    worker_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    ready_timeout_s: float = 600.0
    grace_s: float = 15.0
    children: list[_Child] = field(default_factory=list)
    router_address: str = ""
    metrics_address: str = ""  # the router's /metrics (host:port), once started

    def start(self) -> str:
        """Starts the workers, then the router; returns the router's address. On failure
        everything started is stopped and StackFailure raised."""
        try:
            by_role: dict[str, list[str]] = {}
            group = []
            for index, (role, device) in enumerate(self.workers):
                port = free_port()
                device_flag, env = _device_env(device)
                child = self._launch(f"{self.name}-{role}-{index}", port, env, [
                    "tandem.workers.server", "--role", role, "--model", str(self.model),
                    "--host", "127.0.0.1", "--port", str(port), "--device", device_flag,
                    "--shutdown-grace-seconds", "5", *self.worker_args])
                by_role.setdefault(role, []).append(child.address)
                group.append(child)
            port = free_port()
            metrics_address = f"127.0.0.1:{free_port()}"
            router_argv = ["tandem.router.server", "--model", str(self.model), "--host",
                           "127.0.0.1", "--port", str(port), "--metrics-host", "127.0.0.1",
                           "--metrics-port", metrics_address.rpartition(":")[2],
                           "--health-check-interval", str(HEALTH_INTERVAL_S),
                           "--shutdown-grace-seconds", "5", "--drain-delay-seconds", "0",
                           *self.router_args]
            for role, addresses in by_role.items():
                router_argv += [f"--{role}", ",".join(addresses)]
            router = self._launch(f"{self.name}-router", port, {}, router_argv)
            self._wait_serving(group)
            self._wait_serving([router])
            self._wait_pool(router, metrics_address, len(group))
            self.router_address, self.metrics_address = router.address, metrics_address
            return router.address
        except BaseException:
            self.stop()
            raise

    def check_alive(self) -> None:
        """StackFailure naming the first child that has exited (e.g. died mid-run)."""
        for child in self.children:
            if child.proc.poll() is not None:
                raise StackFailure(f"{child.name} {child.address} exited with code "
                                   f"{child.proc.returncode}; its log ({child.log_path}):\n"
                                   f"{child.tail()}")

    def stop(self) -> None:
        """Router first (started last), then the workers: SIGTERM, wait, SIGKILL the group.
        A second Ctrl-C while waiting kills every child left at once."""
        routers = [c for c in self.children if c.name.endswith("-router")]
        try:
            for group in (routers, [c for c in self.children if c not in routers]):
                running = [c for c in group if c.proc.poll() is None]
                for child in running:
                    _signal_group(child.proc, signal.SIGTERM)
                deadline = time.monotonic() + self.grace_s
                for child in running:
                    try:
                        child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        _signal_group(child.proc, signal.SIGKILL)
                        child.proc.wait()
        except KeyboardInterrupt:
            for child in self.children:
                if child.proc.poll() is None:
                    _signal_group(child.proc, signal.SIGKILL)
            raise
        finally:
            self.children = [c for c in self.children if c.proc.poll() is None]

    def _launch(self, name: str, port: int, env: dict[str, str], argv: list[str]) -> _Child:
        log_path = self.log_dir / f"{name}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", *argv], stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env, **env})
        child = _Child(name, f"127.0.0.1:{port}", proc, log_path)
        self.children.append(child)
        return child

    def _wait_serving(self, group: list[_Child]) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        for child in group:
            with grpc.insecure_channel(child.address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                while not _is_serving(stub):
                    if child.proc.poll() is not None:
                        raise StackFailure(f"{child.name} exited with code "
                                           f"{child.proc.returncode} before it was ready; its "
                                           f"log ({child.log_path}):\n{child.tail()}")
                    if time.monotonic() > deadline:
                        raise StackFailure(f"{child.name} was not SERVING within "
                                           f"{self.ready_timeout_s:g} s; its log "
                                           f"({child.log_path}):\n{child.tail()}")
                    time.sleep(POLL_S)

    def _wait_pool(self, router: _Child, metrics_address: str, num_workers: int) -> None:
        """Until the router's tandem:worker_healthy gauge is 1 for every worker: it may have
        dialled a worker before that one listened, and then retries with a backoff."""
        deadline = time.monotonic() + self.ready_timeout_s
        while _num_healthy(metrics_address) < num_workers:
            if router.proc.poll() is not None or time.monotonic() > deadline:
                raise StackFailure(f"{router.name} did not see {num_workers} healthy workers; "
                                   f"its log ({router.log_path}):\n{router.tail()}")
            time.sleep(POLL_S)


    @property
    def worker_children(self) -> list[_Child]:
        return [c for c in self.children if not c.name.endswith("-router")]

    def wait_idle(self, timeout_s: float = 30.0) -> bool:
        """Until every worker reports nothing running or waiting (the previous run's
        stragglers and aborted requests are gone; pinned KV awaiting its lease costs no
        compute); False when `timeout_s` passes first."""
        from tandem.v1 import worker_pb2, worker_pb2_grpc

        deadline = time.monotonic() + timeout_s
        for child in self.worker_children:
            with grpc.insecure_channel(child.address) as channel:
                stub = worker_pb2_grpc.WorkerStub(channel)
                while True:
                    try:
                        load = stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=2.0)
                        if not (load.num_running or load.num_waiting):
                            break
                    except grpc.RpcError:
                        pass
                    if time.monotonic() > deadline:
                        return False
                    time.sleep(POLL_S)
        return True

    def router_cpu_seconds(self) -> float | None:
        """CPU time (user + system) the router has used so far, over all its processes (a
        `--processes` supervisor and the routers it runs); None off Linux."""
        router = next((c for c in self.children if c.name.endswith("-router")), None)
        if router is None or process_cpu_seconds(router.proc.pid) is None:
            return None
        return tree_cpu_seconds(router.proc.pid)


def _num_healthy(metrics_address: str) -> int:
    """Workers the router's /metrics reports healthy (0 while it does not answer)."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=2) as reply:
            text = reply.read().decode()
    except OSError:
        return 0
    return sum(1 for line in text.splitlines()
               if line.startswith("tandem:worker_healthy{") and float(line.split()[-1]) == 1)


def _device_env(device: str) -> tuple[str, dict[str, str]]:
    """("cuda", {"CUDA_VISIBLE_DEVICES": "N"}) for "cuda:N"; other devices as they are."""
    if device.startswith("cuda:"):
        return "cuda", {"CUDA_VISIBLE_DEVICES": device.partition(":")[2]}
    return device, {}


def _is_serving(stub) -> bool:
    try:
        reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    """The child leads its own process group (start_new_session): signal all of it, so a TP
    worker's follower ranks go too."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass


def write_tokenizer(directory: Path) -> None:
    """A byte-level tokenizer without merges: ids 0-255 are the bytes, then <|bos|>, <|eos|>
    and <|pad|> as special tokens (259 ids, fewer than any real model's vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|bos|>", "<|eos|>", "<|pad|>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|bos|>",
                                   eos_token="<|eos|>", pad_token="<|pad|>")
    fast.save_pretrained(directory)


def build_tiny_checkpoint(directory: Path) -> Path:
    """A 2-layer Llama (hidden 64, vocab 512, 512 positions) with random weights, fp32,
    saved with transformers' save_pretrained, plus write_tokenizer's tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, initializer_range=0.1, bos_token_id=256,
                         eos_token_id=511)
    LlamaForCausalLM(config).eval().save_pretrained(directory)
    write_tokenizer(directory)
    return directory
