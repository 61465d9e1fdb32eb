"""The default model's one-time conversion reports how far it is, not a time promise."""
from __future__ import annotations

import time

import transformers.modeling_gguf_pytorch_utils as gguf_utils

from tandem.common import default_model
from tandem.common.default_model import LoggedProgress


def test_progress_lines_count_items_and_end_with_the_total():
    lines = []
    items = list(LoggedProgress(range(7), label="dequantized tensors",
                                log=lambda fmt, *args: lines.append(fmt % args), interval_s=0))
    assert items == list(range(7))
    assert [line.rsplit(" (", 1)[0] for line in lines] == [
        f"dequantized tensors {n}/7" for n in range(1, 8)]
    quiet = []
    list(LoggedProgress(range(50), label="x", log=lambda *a: quiet.append(a), interval_s=3600))
    assert len(quiet) == 1  # only the final count within the interval


def test_the_gguf_reader_logs_progress_lines_while_converting():
    lines = []
    original = gguf_utils.tqdm
    with default_model._library_progress_bars(True, lambda fmt, *a: lines.append(fmt % a)):
        # What transformers' GGUF reader calls for its tensor loop.
        list(gguf_utils.tqdm(["a", "b", "c"], desc="Converting and de-quantizing GGUF tensors"))
    assert gguf_utils.tqdm is original
    assert lines and lines[-1].startswith("dequantized tensors 3/3 (")
    with default_model._library_progress_bars(False, lines.append):
        assert list(gguf_utils.tqdm(["a"], desc="quiet")) == ["a"]
    assert len(lines) == 1


def test_a_long_step_repeats_a_still_working_line(monkeypatch):
    monkeypatch.setattr(default_model, "PROGRESS_INTERVAL_S", 0.02)
    lines = []
    with default_model._Heartbeat(lambda fmt, *a: lines.append(fmt % a)) as heartbeat:
        heartbeat.step("[2/3] reading the weights (%s)", "slow")
        deadline = time.monotonic() + 30
        while not any("still working" in line for line in lines):
            assert time.monotonic() < deadline, lines
            time.sleep(0.01)
    assert lines[0] == "[2/3] reading the weights (slow)"
    assert any(line.startswith("[2/3] reading the weights: still working (") for line in lines)
    num_lines = len(lines)
    time.sleep(0.1)
    assert len(lines) == num_lines  # the thread stopped with the conversion
