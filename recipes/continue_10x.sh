#!/usr/bin/env bash
# Continue the 10x reference-drafter run by one stage, from wherever the repository says it stands.
#
#   bash recipes/continue_10x.sh        # then commit what it prints; the next session runs it again
#
# The run outlasts sessions and machines, so its progress lives in the repository, never in RUN
# (a scratch directory, default ~/.cache/vlmspec/runs/reference-10x, that a new machine starts empty):
#   recipes/reference_10x.state          how far it got (this script rewrites it);
#   recipes/data/reference-10x/          the target's regenerated answers, token ids only, one file per
#                                        shard, each written once (vlmspec.training.answers; ~3 MB in all);
#   vlmspec/assets/reference-drafter/dspark   the drafter every chunk starts from, in float16; replaced only
#                                        by a chunk that beats it on held-out tau.
# Optimizer state, caches and checkpoints stay in RUN and are never committed: a chunk starts with a
# fresh optimizer from the committed drafter.
#
# Stages (each under 2 hours of this 2-core CPU; recipes/README.md "The 10x run" has the measured costs):
#   1. regeneration, SHARD_PROMPTS (2048: about 45 minutes with the machine to itself) more training
#      prompts a stage: the committed answers are replayed into RUN/cache in minutes, the next prompts
#      of the seeded order are regenerated, and their answers are written as the next answers-NNNNN.npz;
#   2. once every prompt is answered, training chunks of CHUNK_STEPS (6000) steps of the DSpark drafter
#      (one sequence, up to 128 anchor blocks a step, features online, bf16 autocast, first-error focus),
#      warm-started from the committed drafter; the recipe measures free-running greedy tau on the 16
#      held-out prompts before and after, and the drafter is shipped (float16) only if it went up.
#      NEXT=train runs a chunk before regeneration has finished, on the prompts answered so far (their own
#      cache, replayed from the committed answers, so a chunk trains on exactly what the repository holds).
set -euo pipefail
cd "$(dirname "$0")/.."
source recipes/reference_mix.sh
STATE=recipes/reference_10x.state
ANSWERS=recipes/data/reference-10x
SHIPPED=vlmspec/assets/reference-drafter/dspark
source "$STATE"
RUN="${RUN:-$HOME/.cache/vlmspec/runs/reference-10x}"
SHARD_PROMPTS="${SHARD_PROMPTS:-2048}"
CHUNK_STEPS="${CHUNK_STEPS:-6000}"
TRAIN_THREADS="${TRAIN_THREADS:-2}"  # the stage has the machine to itself
NEXT="${NEXT:-}"                     # "train": a chunk on the prompts answered so far
HELDOUT=16

if [[ ! -f "$RUN/prompts/prompts.jsonl" ]]; then  # seeded: every machine writes the same mix
  python3 recipes/reference_prompts.py --out "$RUN/prompts" "${REFERENCE_MIX[@]}"
fi
TOTAL=$(( $(wc -l < "$RUN/prompts/prompts.jsonl") - HELDOUT ))

# The reference drafters' data and shape (train_reference_drafters.sh); --answers replays what is committed.
COMMON=(--target reference --prompts "$RUN/prompts/prompts.jsonl" --heldout-prompts "$HELDOUT"
        --max-new-tokens 256 --temperature 0 --cache-contents tokens --answers "$ANSWERS"
        --shard-size 256 --regen-dtype bfloat16 --block-size 7 --draft-layers 2 --head-rank 64 --draft-vocab 8192)

write_state() {  # REGENERATED TRAINED IMPROVED
  sed -i -e "s/^REGENERATED_PROMPTS=[0-9]*/REGENERATED_PROMPTS=$1/" -e "s/^TRAINED_CHUNKS=[0-9]*/TRAINED_CHUNKS=$2/" \
      -e "s/^IMPROVED_CHUNKS=[0-9]*/IMPROVED_CHUNKS=$3/" "$STATE"
}

if [[ "$NEXT" != train ]] && (( REGENERATED_PROMPTS < TOTAL )); then
  next=$(( REGENERATED_PROMPTS + SHARD_PROMPTS < TOTAL ? REGENERATED_PROMPTS + SHARD_PROMPTS : TOTAL ))
  echo "10x run: regeneration stage, training prompts $REGENERATED_PROMPTS -> $next of $TOTAL"
  python3 recipes/train_qwen3vl.py "${COMMON[@]}" --cache "$RUN/cache" --num-prompts "$next" --dtype bfloat16 --regen-batch-size 64 \
      --threads 2 --cache-only --out "$RUN/cache-build"
  write_state "$next" "$TRAINED_CHUNKS" "$IMPROVED_CHUNKS"
  echo "commit it: git add $STATE $ANSWERS && git commit -m \"10x run: answers of $next training prompts\""
  exit 0
fi

chunk=$(( TRAINED_CHUNKS + 1 ))
echo "10x run: training chunk $chunk ($CHUNK_STEPS steps) on $REGENERATED_PROMPTS answered prompts, warm-started from $SHIPPED"
# Its own cache: exactly the committed answers, replayed (RUN/cache may hold shards of an unfinished stage).
OMP_NUM_THREADS="$TRAIN_THREADS" python3 recipes/train_qwen3vl.py "${COMMON[@]}" --cache "$RUN/chunk-$chunk-cache" \
    --num-prompts "$REGENERATED_PROMPTS" --init-from "$SHIPPED" --dtype float32 --threads "$TRAIN_THREADS" \
    --steps "$CHUNK_STEPS" --batch-size 1 --num-anchors 128 --lr 1e-3 --warmup-ratio 0.01 --mixed-precision bf16 \
    --chunk-tokens 1024 --eval-every 1000 --eval-sequences 32 --save-every 250 --log-every 50 \
    --eval-max-new-tokens 64 --loss-focus first-error --out "$RUN/chunk-$chunk"
# "untrained" is the starting drafter, measured on the same held-out prompts in the same run.
if python3 - "$RUN/chunk-$chunk/report.json" <<'EOF'
import json, sys
report = json.load(open(sys.argv[1]))
before, after = report["untrained"], report["trained"]
print(f"held-out free-running tau: {before['tau']:.3f} -> {after['tau']:.3f} ({after['rounds']} rounds)")
sys.exit(0 if after["identical_to_target"] and after["tau"] > before["tau"] else 1)
EOF
then
  python3 recipes/ship_reference_drafter.py --run "$RUN/chunk-$chunk" --name dspark
  write_state "$REGENERATED_PROMPTS" "$chunk" $(( IMPROVED_CHUNKS + 1 ))
  echo "commit it: git add $STATE $SHIPPED && git commit -m \"10x run: chunk $chunk drafter beats the shipped one\""
else
  write_state "$REGENERATED_PROMPTS" "$chunk" "$IMPROVED_CHUNKS"
  echo "no improvement: the shipped drafter stays. commit it: git add $STATE && git commit -m \"10x run: chunk $chunk\""
fi
