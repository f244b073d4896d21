#!/usr/bin/env bash
# The README's test command: install into a fresh virtualenv, then run the whole test suite.
# torch is installed first, pinned to the CPU build this project's machines keep on disk, so that the
# test-only dependencies that need torch (transformers, flash-attn-4, tokenspeed-mla) do not pull a
# multi-GB CUDA build; on a GPU machine install the torch you use instead.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]"
python -m pytest -q -ra "$@"
