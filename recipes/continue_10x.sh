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
# Stages (each under 2 hours of this 2-core CPU; recipes/README.md "The 10x run" has the measured costs),
# alternating so that every session can run one of each and the drafter learns from the answers as they come:
#   regeneration, SHARD_PROMPTS (2048: 15-45 minutes, by what else runs) more training prompts:
#      the committed answers are replayed into RUN/cache in minutes, the next prompts of the seeded order
#      are regenerated, and their answers are written as the next answers-NNNNN.npz;
#   a training chunk, whenever prompts were answered since the last chunk (and, once every prompt is
#      answered, every stage): CHUNK_STEPS (6000, about 1.7 hours with its held-out decoding) steps of the DSpark drafter on the
#      prompts answered so far (one sequence, up to 128 anchor blocks a step, features online, bf16
#      autocast, first-error focus) in their own cache replayed from the committed answers, warm-started
#      from the committed drafter with a fresh optimizer; the recipe measures free-running greedy tau on
#      the 16 held-out prompts before and after, and the drafter is shipped (float16) only if it went up.
# NEXT=regen or NEXT=train runs that stage instead of the one due.
set -euo pipefail
cd "$(dirname "$0")/.."
source recipes/reference_mix.sh
STATE=recipes/reference_10x.state
ANSWERS=recipes/data/reference-10x
# The chunks' held-out cached sequences, by id: chunk 1's seeded 32, so every chunk evaluates on the same
# sequences and none trains on them (or on their other turns) however many prompts are answered.
EVAL_IDS=$ANSWERS/eval-ids.txt
SHIPPED=vlmspec/assets/reference-drafter/dspark
source "$STATE"
RUN="${RUN:-$HOME/.cache/vlmspec/runs/reference-10x}"
SHARD_PROMPTS="${SHARD_PROMPTS:-2048}"
CHUNK_STEPS="${CHUNK_STEPS:-6000}"
TRAIN_THREADS="${TRAIN_THREADS:-2}"  # the stage has the machine to itself
TRAINED_ON_PROMPTS="${TRAINED_ON_PROMPTS:-0}"  # state files written before chunks alternated lack it
HELDOUT=16

if [[ ! -f "$RUN/prompts/prompts.jsonl" ]]; then  # seeded: every machine writes the same mix
  python3 recipes/reference_prompts.py --out "$RUN/prompts" "${REFERENCE_MIX[@]}"
fi
TOTAL=$(( $(wc -l < "$RUN/prompts/prompts.jsonl") - HELDOUT ))

# The reference drafters' data and shape (train_reference_drafters.sh); --answers replays what is committed.
COMMON=(--target reference --prompts "$RUN/prompts/prompts.jsonl" --heldout-prompts "$HELDOUT"
        --max-new-tokens 256 --temperature 0 --cache-contents tokens --answers "$ANSWERS"
        --shard-size 256 --regen-dtype bfloat16 --block-size 7 --draft-layers 2 --head-rank 64 --draft-vocab 8192)

write_state() {  # REGENERATED TRAINED IMPROVED TRAINED_ON
  cat > "$STATE" <<STATE_FILE
# Where the 10x run stands. recipes/continue_10x.sh reads this file, runs the next stage and rewrites it;
# commit it together with what the stage produced (it prints the git command). Nothing else carries
# the run from one machine to the next.
REGENERATED_PROMPTS=$1  # training prompts (in the seeded order) whose answers are in $ANSWERS/
TRAINED_CHUNKS=$2       # training chunks finished, each warm-started from $SHIPPED
IMPROVED_CHUNKS=$3      # of those, the chunks whose drafter beat its starting point and replaced the shipped one
TRAINED_ON_PROMPTS=$4   # answered prompts the last chunk trained on (more answered since: a chunk is due)
STATE_FILE
}

if [[ -z "${NEXT:-}" ]]; then  # the stage that is due: a chunk on new answers, else more answers, else a chunk
  if (( REGENERATED_PROMPTS > TRAINED_ON_PROMPTS || REGENERATED_PROMPTS >= TOTAL )); then NEXT=train; else NEXT=regen; fi
fi
if [[ "$NEXT" != train && "$NEXT" != regen ]]; then
  echo "NEXT=$NEXT: give NEXT=regen or NEXT=train, or leave it unset for the stage that is due" >&2
  exit 2
fi

if [[ "$NEXT" == regen ]]; then
  if (( REGENERATED_PROMPTS >= TOTAL )); then
    echo "10x run: all $TOTAL training prompts are answered; what is left is training chunks (leave NEXT unset)"
    exit 0
  fi
  next=$(( REGENERATED_PROMPTS + SHARD_PROMPTS < TOTAL ? REGENERATED_PROMPTS + SHARD_PROMPTS : TOTAL ))
  echo "10x run: regeneration stage, training prompts $REGENERATED_PROMPTS -> $next of $TOTAL"
  python3 recipes/train_qwen3vl.py "${COMMON[@]}" --cache "$RUN/cache" --num-prompts "$next" --dtype bfloat16 --regen-batch-size 64 \
      --threads 2 --cache-only --out "$RUN/cache-build"
  write_state "$next" "$TRAINED_CHUNKS" "$IMPROVED_CHUNKS" "$TRAINED_ON_PROMPTS"
  echo "commit it: git add $STATE $ANSWERS && git commit -m \"10x run: answers of $next training prompts\""
  exit 0
fi

chunk=$(( TRAINED_CHUNKS + 1 ))
echo "10x run: training chunk $chunk ($CHUNK_STEPS steps) on $REGENERATED_PROMPTS answered prompts, warm-started from $SHIPPED"
# Its own cache: exactly the committed answers, replayed (RUN/cache may hold shards of an unfinished stage).
OMP_NUM_THREADS="$TRAIN_THREADS" python3 recipes/train_qwen3vl.py "${COMMON[@]}" --cache "$RUN/chunk-$chunk-cache" \
    --num-prompts "$REGENERATED_PROMPTS" --init-from "$SHIPPED" --dtype float32 --threads "$TRAIN_THREADS" \
    --steps "$CHUNK_STEPS" --batch-size 1 --num-anchors 128 --lr 1e-3 --warmup-ratio 0.01 --mixed-precision bf16 \
    --chunk-tokens 1024 --eval-every 1000 --eval-ids "$EVAL_IDS" --save-every 250 --log-every 50 \
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
  write_state "$REGENERATED_PROMPTS" "$chunk" $(( IMPROVED_CHUNKS + 1 )) "$REGENERATED_PROMPTS"
  echo "commit it: git add $STATE $SHIPPED && git commit -m \"10x run: chunk $chunk drafter beats the shipped one\""
else
  write_state "$REGENERATED_PROMPTS" "$chunk" "$IMPROVED_CHUNKS" "$REGENERATED_PROMPTS"
  echo "no improvement: the shipped drafter stays. commit it: git add $STATE && git commit -m \"10x run: chunk $chunk\""
fi
