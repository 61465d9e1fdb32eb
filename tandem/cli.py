"""The `tandem` command. Subcommands arrive with the services (router, worker, up, bench)."""
from __future__ import annotations

import argparse
import sys

from tandem import SamplingParams, __version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated LLM serving.")
    parser.add_argument("--version", action="version", version=f"tandem {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="run prompts through the engine in this process")
    gen.add_argument("--model", required=True, help="HF checkpoint folder")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--dtype", default="auto")
    gen.add_argument("prompts", nargs="+")
    args = parser.parse_args(argv)
    from tandem import LLM

    try:
        llm = LLM(args.model, dtype=args.dtype)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
        for out in llm.generate(list(args.prompts), params):
            print(out.text)
    except ValueError as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
