"""The mori backend where MoRI-IO is not installed (every machine here; the backend itself is
untested, workers/kv/mori_connector.py): `--kv-transfer mori` is refused at start-up with the
reason, before the model loads, and nothing imports mori; auto does not run it off ROCm."""
from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tandem.workers.kv import connectors
from tandem.workers.kv.transport import KV_TRANSFER_MODES, check_kv_transfer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("mori") is not None,
                                reason="mori is installed here")


def test_mori_is_a_registered_mode_that_says_why_it_cannot_run():
    assert "mori" in KV_TRANSFER_MODES and "mori" in connectors.connector_backends()
    with pytest.raises(ValueError, match="--kv-transfer mori: MoRI-IO is not installed"):
        check_kv_transfer("mori", "cuda")
    assert not connectors.wanted_in_auto("mori", "cuda")


def test_a_worker_asked_for_mori_refuses_to_start_before_loading(tmp_path):
    """The model path does not exist: the refusal comes before anything is loaded."""
    code = ("import sys; from tandem.workers.server import main; "
            "code = main(sys.argv[1:]); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'mori')); "
            "sys.exit(code)")
    result = subprocess.run(
        [sys.executable, "-c", code, "--role", "decode", "--model", str(tmp_path / "none"),
         "--port", "1", "--kv-transfer", "mori"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "tandem worker: error: --kv-transfer mori: MoRI-IO is not installed" in \
        result.stderr
    assert result.stdout.strip() == "[]"
