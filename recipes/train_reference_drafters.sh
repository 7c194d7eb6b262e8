#!/usr/bin/env bash
# Train the drafters that ship with vlmspec for the reference target (vlmspec.reference):
# DSpark (vanilla Markov head, rank 64) and its DFlash ablation (no sequential head), on the
# same cache, with the same steps and backbone; then copy both into the package in float16.
#
#   bash recipes/train_reference_drafters.sh [OUT]        # OUT defaults to runs/reference-drafter
#
# On 2 shared CPU cores: cache ~12 min, each training ~19 min + ~2 min of held-out decoding
# and calibration. The settings are sized for that budget (see recipes/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-runs/reference-drafter}"
PROCS="${PROCS:-2}"   # CPU processes (gloo); steps are global, so the batch is PROCS x --batch-size

python3 recipes/reference_prompts.py --out "$OUT/prompts"

COMMON=(--target reference --prompts "$OUT/prompts/prompts.jsonl" --heldout-prompts 16
        --dtype float32 --threads 1 --max-new-tokens 128 --temperature 0 --first-turn-only
        --cache "$OUT/cache" --shard-size 32
        --block-size 7 --draft-layers 2 --head-rank 64 --chunk-tokens 256
        --eval-sequences 16 --eval-max-new-tokens 64
        --steps 800 --batch-size 1 --num-anchors 32 --lr 1e-3 --warmup-ratio 0.05
        --eval-every 0 --save-every 200 --log-every 10 --skip-untrained-eval)

for head in vanilla none; do
  name=$([[ $head == none ]] && echo dflash || echo dspark)
  ACCELERATE_USE_CPU=1 OMP_NUM_THREADS=1 torchrun --nproc_per_node "$PROCS" \
      recipes/train_qwen3vl.py "${COMMON[@]}" --head "$head" --out "$OUT/$name"
  python3 recipes/ship_reference_drafter.py --run "$OUT/$name" --name "$name"
done
