"""Tandem: disaggregated LLM serving (router, prefill workers, decode workers).

The offline API runs the same engine a worker runs, in this process::

    from tandem import LLM, SamplingParams
    llm = LLM(model="/path/to/hf_checkpoint")
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=16))
"""
from tandem.common.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and transformers; import it on first use so `import tandem` stays light.
    if name in ("LLM", "RequestOutput"):
        from tandem import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'tandem' has no attribute {name!r}")
