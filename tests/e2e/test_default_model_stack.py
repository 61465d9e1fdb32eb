"""The quickstart path: `tandem up` with no --model serves the default model, and
`tandem generate --chat` streams an answer containing "Paris" that equals the offline answer."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from helpers.processes import free_port, wait_serving, Process

from tandem import LLM, SamplingParams
from tandem.common.default_model import DEFAULT_MODEL_NAME

QUESTION = "What is the capital of France?"


@pytest.mark.slow
def test_tandem_up_serves_the_default_model_and_generate_streams_paris(default_model_cache,
                                                                       tmp_path):
    env = dict(os.environ, TANDEM_CACHE_DIR=str(default_model_cache), OMP_NUM_THREADS="1")
    port = free_port()
    log_path = tmp_path / "up.log"
    up = subprocess.Popen([sys.executable, "-m", "tandem.cli", "up", "--port", str(port)],
                          stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env,
                          start_new_session=True)
    try:
        wait_serving([Process("tandem-up", f"127.0.0.1:{port}", up, log_path)])
        result = subprocess.run(
            [sys.executable, "-m", "tandem.cli", "generate", "--router", f"127.0.0.1:{port}",
             "--chat", QUESTION, "--max-tokens", "24"],
            capture_output=True, text=True, env=env, timeout=120)
        assert result.returncode == 0, result.stderr
        assert "Paris" in result.stdout
        assert "ttft" in result.stderr.lower()
        # The same answer as the offline engine on the same converted folder.
        model_dir = default_model_cache / "models" / DEFAULT_MODEL_NAME
        llm = LLM(model_dir, dtype="float32")
        prompt = llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": QUESTION}], add_generation_prompt=True,
            return_dict=False)
        [offline] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24))
        assert result.stdout.strip() == offline.text.strip()
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0, log_path.read_text()[-3000:]
