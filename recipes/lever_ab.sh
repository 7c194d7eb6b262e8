#!/usr/bin/env bash
# The cheap levers of the reference drafter, A/B at one fixed budget (#21): every arm trains
# STEPS steps on the same held-out split of the 10x prompt mix, with the same seed, anchors
# and schedule as recipes/train_reference_drafters.sh, and changes one thing:
#
#   base     2 layers, 5 hooked target layers (1,8,14,21,28), greedy regenerated answers
#   layers3  3 drafter layers
#   hooks9   9 hooked target layers (1,4,8,11,14,18,21,25,28)
#   sampled  answers regenerated at T=0.7, top-p 0.8, top-k 20 (the others: greedy, T=0)
#
#   bash recipes/lever_ab.sh                 # RUN defaults to ~/.cache/vlmspec/runs/lever-ab
#
# Two arms train at a time, one thread each; every arm resumes from its newest checkpoint
# when the script is started again. Read the result with learning_curve.py's table
# (teacher-forced tau on each arm's held-out cached answers; the sampled arm's are sampled
# answers) and with the free-running greedy tau on the same 16 held-out prompts that each
# arm prints at the end (the number that compares all four; the script repeats it).
set -euo pipefail
cd "$(dirname "$0")/.."
source recipes/reference_mix.sh
RUN="${RUN:-$HOME/.cache/vlmspec/runs/lever-ab}"
STEPS="${STEPS:-400}"
PROMPTS="${PROMPTS:-1200}"

if [[ ! -f "$RUN/prompts/prompts.jsonl" ]]; then
  python3 recipes/reference_prompts.py --out "$RUN/prompts" "${REFERENCE_MIX[@]}"
fi

COMMON=(--target reference --prompts "$RUN/prompts/prompts.jsonl" --num-prompts "$PROMPTS" --heldout-prompts 16
        --dtype float32 --max-new-tokens 256 --cache-contents tokens --shard-size 128 --regen-dtype bfloat16
        --block-size 7 --head-rank 64 --draft-vocab 8192)
GREEDY=(--temperature 0 --cache "$RUN/cache-greedy")
SAMPLED=(--temperature 0.7 --top-p 0.8 --top-k 20 --cache "$RUN/cache-sampled")
for data in GREEDY SAMPLED; do
  declare -n args=$data
  python3 recipes/train_qwen3vl.py "${COMMON[@]}" "${args[@]}" --regen-batch-size 64 --threads 2 --cache-only \
      --out "$RUN/cache-build-${data,,}"
done

TRAIN=(--threads 1 --steps "$STEPS" --batch-size 1 --num-anchors 128 --lr 1e-3 --warmup-ratio 0.01
       --mixed-precision bf16 --chunk-tokens 1024 --eval-every 100 --eval-sequences 16 --save-every 100
       --log-every 50 --eval-max-new-tokens 64 --skip-untrained-eval --skip-calibration --head vanilla)
arm() {  # NAME DATA ARGS...
  local name=$1 data=$2; shift 2
  declare -n data_args=$data
  OMP_NUM_THREADS=1 python3 recipes/train_qwen3vl.py "${COMMON[@]}" "${data_args[@]}" "${TRAIN[@]}" "$@" \
      --out "$RUN/$name" >> "$RUN/$name.log" 2>&1
}
arm base GREEDY --draft-layers 2 & arm layers3 GREEDY --draft-layers 3 & wait
arm hooks9 GREEDY --draft-layers 2 --feature-layers 1,4,8,11,14,18,21,25,28 &
arm sampled SAMPLED --draft-layers 2 & wait

python3 recipes/learning_curve.py --out "$RUN/curve" \
    --run "$RUN/base" --run "$RUN/layers3" --run "$RUN/hooks9" --run "$RUN/sampled" \
    --name base --name layers3 --name hooks9 --name sampled
for name in base layers3 hooks9 sampled; do  # the free-running held-out tau each arm's recipe printed
  echo "$name: $(grep -h 'trained drafter: tau' "$RUN/$name.log" | tail -1)"
done
