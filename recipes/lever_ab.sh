#!/usr/bin/env bash
# The cheap levers of the reference drafter, A/B at one fixed budget (#21): every arm trains
# STEPS steps on the same held-out split of the 10x prompt mix, with the same seed, anchors
# and schedule, and changes one thing against base:
#
#   base     2 layers, 5 hooked target layers (1,8,14,21,28), greedy regenerated answers
#   layers3  3 drafter layers
#   hooks9   9 hooked target layers (1,4,8,11,14,18,21,25,28) (needs CONTENTS=tokens: a feature
#            cache stores the base's 5 layers only)
#   sampled  answers regenerated at T=0.7, top-p 0.8, top-k 20 (the others: greedy, T=0)
#   warm     layers warm-started from the target's last two (--init-from-target)
#   focus    first-error-focused position weights (--loss-focus first-error)
#   warmfocus  both of the last two
#
#   bash recipes/lever_ab.sh                 # RUN defaults to ~/.cache/vlmspec/runs/lever-ab
#
# Knobs (environment): ARMS (default "base layers3 hooks9 sampled", the first A/B), STEPS (400),
# PROMPTS (1200 of the mix), CONTENTS (tokens: features online; features: stored), ANCHORS (128),
# GREEDY_CACHE (default RUN/cache-greedy; point it at another run's cache of the same prompts
# and contents to share it). The second A/B:
#   RUN=~/.cache/vlmspec/runs/lever-ab-2 ARMS="base warm focus warmfocus" STEPS=1500 PROMPTS=4096 \
#   CONTENTS=features ANCHORS=32 GREEDY_CACHE=~/.cache/vlmspec/runs/ship-3x/cache bash recipes/lever_ab.sh
#
# Two arms train at a time, one thread each; every arm resumes from its newest checkpoint
# when the script is started again. Read the result with learning_curve.py's table
# (teacher-forced tau on each arm's held-out cached answers; the sampled arm's are sampled
# answers) and with the free-running greedy tau on the same 16 held-out prompts that each
# arm prints at the end (the number that compares all arms; the script repeats it).
set -euo pipefail
cd "$(dirname "$0")/.."
source recipes/reference_mix.sh
RUN="${RUN:-$HOME/.cache/vlmspec/runs/lever-ab}"
read -r -a ARMS <<< "${ARMS:-base layers3 hooks9 sampled}"
STEPS="${STEPS:-400}"
PROMPTS="${PROMPTS:-1200}"
CONTENTS="${CONTENTS:-tokens}"
ANCHORS="${ANCHORS:-128}"

if [[ ! -f "$RUN/prompts/prompts.jsonl" ]]; then
  python3 recipes/reference_prompts.py --out "$RUN/prompts" "${REFERENCE_MIX[@]}"
fi

COMMON=(--target reference --prompts "$RUN/prompts/prompts.jsonl" --num-prompts "$PROMPTS" --heldout-prompts 16
        --max-new-tokens 256 --cache-contents "$CONTENTS" --shard-size 128 --regen-dtype bfloat16
        --block-size 7 --head-rank 64 --draft-vocab 8192)
GREEDY=(--temperature 0 --cache "${GREEDY_CACHE:-$RUN/cache-greedy}")
SAMPLED=(--temperature 0.7 --top-p 0.8 --top-k 20 --cache "$RUN/cache-sampled")
declare -A LEVER=(
  [base]="GREEDY --draft-layers 2"
  [layers3]="GREEDY --draft-layers 3"
  [hooks9]="GREEDY --draft-layers 2 --feature-layers 1,4,8,11,14,18,21,25,28"
  [sampled]="SAMPLED --draft-layers 2"
  [warm]="GREEDY --draft-layers 2 --init-from-target"
  [focus]="GREEDY --draft-layers 2 --loss-focus first-error"
  [warmfocus]="GREEDY --draft-layers 2 --init-from-target --loss-focus first-error"
)
for name in "${ARMS[@]}"; do
  [[ -v "LEVER[$name]" ]] || { echo "unknown arm $name; choose among ${!LEVER[*]}" >&2; exit 2; }
done

# The caches the arms need, built once with both threads (bfloat16 target: answers and stored states).
for data in $(for name in "${ARMS[@]}"; do echo "${LEVER[$name]%% *}"; done | sort -u); do
  declare -n args=$data
  python3 recipes/train_qwen3vl.py "${COMMON[@]}" "${args[@]}" --dtype bfloat16 --regen-batch-size 64 --threads 2 \
      --cache-only --out "$RUN/cache-build-${data,,}"
done

TRAIN=(--dtype float32 --threads 1 --steps "$STEPS" --batch-size 1 --num-anchors "$ANCHORS" --lr 1e-3
       --warmup-ratio 0.01 --mixed-precision bf16 --chunk-tokens 1024 --eval-every 100 --eval-sequences 16
       --save-every 100 --log-every 50 --eval-max-new-tokens 64 --skip-untrained-eval --skip-calibration
       --head vanilla)
arm() {  # NAME: trains one arm, one thread
  local name=$1
  read -r -a lever <<< "${LEVER[$name]}"
  declare -n data_args=${lever[0]}
  OMP_NUM_THREADS=1 python3 recipes/train_qwen3vl.py "${COMMON[@]}" "${data_args[@]}" "${TRAIN[@]}" "${lever[@]:1}" \
      --out "$RUN/$name" >> "$RUN/$name.log" 2>&1
}
for ((i = 0; i < ${#ARMS[@]}; i += 2)); do  # two at a time
  arm "${ARMS[i]}" &
  [[ -n "${ARMS[i + 1]:-}" ]] && arm "${ARMS[i + 1]}" &
  wait
done

curve=()
for name in "${ARMS[@]}"; do curve+=(--run "$RUN/$name" --name "$name"); done
python3 recipes/learning_curve.py --out "$RUN/curve" "${curve[@]}"
for name in "${ARMS[@]}"; do  # the free-running held-out tau each arm's recipe printed
  echo "$name: $(grep -h 'trained drafter: tau' "$RUN/$name.log" | tail -1)"
done
