"""How the decode MoE kernels' launch settings follow the batch, the experts and the device
(workers/ops/gpu/moe_decode.default_config; the kernels themselves: tests/gpu and
tests/interpreted)."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tandem.workers.ops.gpu import moe_decode  # noqa: E402  (needs triton)

H100_SMS = 132


@pytest.mark.parametrize("num_pairs, intermediate, expected", [
    (8, 768, 16),     # Qwen3-30B-A3B batch 1: 96 programs at 64 columns, 384 at 16
    (16, 768, 32),    # its batch 2: 384 programs at 32 columns, 768 at 16 queue
    (8, 2048, 64),    # DeepSeek-V3 batch 1: 256 programs at 64 columns already
    (2, 14336, 64),   # Mixtral batch 1 (top-2)
    (4, 2880, 32),    # GPT-OSS batch 1 (top-4)
    (1, 64, 16),      # too few columns for any width: the narrowest
])
def test_gate_up_slab_narrows_until_every_sm_has_programs(num_pairs, intermediate, expected):
    config = moe_decode.default_config(num_pairs, intermediate, H100_SMS)
    assert config["gate_up_block_n"] == expected
    programs = num_pairs * -(-intermediate // expected)
    if expected < 64:  # the next wider slab would leave SMs short of programs
        wider = num_pairs * -(-intermediate // (2 * expected))
        assert wider < moe_decode.GATE_UP_PROGRAMS_PER_SM * H100_SMS
    else:
        assert programs >= moe_decode.GATE_UP_PROGRAMS_PER_SM * H100_SMS
    assert config["down_block_n"] == 64  # the down kernel's grid is over hidden columns


def test_larger_batches_and_unknown_devices_keep_the_tuned_widths():
    assert moe_decode.default_config(8)["gate_up_block_n"] == 64  # no sizes given
    assert moe_decode.default_config(8, 768, None)["gate_up_block_n"] == 64
    for num_pairs, width in ((17, 32), (64, 32), (65, 64), (1024, 64)):
        config = moe_decode.default_config(num_pairs, 768, H100_SMS)
        assert config["gate_up_block_n"] == config["down_block_n"] == width
