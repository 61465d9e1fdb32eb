"""Diagnose greedy parity of a tiny MoE checkpoint on aiter-triton (decode kernels on / off)."""
import sys
sys.path.insert(0, "tests")
import torch
from helpers.moe_checkpoints import build_moe_checkpoint
from helpers.checkpoints import PARITY_LENGTHS, random_prompts
from tandem import LLM, SamplingParams
from tandem.workers.ops import kernel_options
from pathlib import Path
import tempfile

name = sys.argv[1]
ckpt = build_moe_checkpoint(name, Path(tempfile.mkdtemp()))
greedy = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)
prompts = [p[:30] for p in random_prompts(PARITY_LENGTHS, seed=43)]
for label, on, kernels in (("decode on", True, "aiter-triton"), ("decode off", False, "aiter-triton"),
                           ("torch", True, "torch")):
    kernel_options.install(kernel_options.KernelOptions(moe_decode=on))
    llm = LLM(ckpt.path, dtype="float32", device="cuda", kernels=kernels, max_num_seqs=8)
    for i, (prompt, out) in enumerate(zip(prompts, llm.generate(prompts, greedy))):
        ref = ckpt.greedy(prompt, 24)
        if out.token_ids != ref:
            step = next(j for j, (a, b) in enumerate(zip(out.token_ids, ref)) if a != b)
            logits = ckpt.logits(prompt + ref)[len(prompt) - 1 + step]
            top = logits.topk(2)
            print(f"{label}: prompt {i} len {len(prompt)} differs at step {step}: got "
                  f"{out.token_ids[step]} want {ref[step]}; hf top2 gap "
                  f"{(top.values[0]-top.values[1]).item():.2e}")
    print(label, "done")
    del llm
    torch.cuda.empty_cache()
