#!/usr/bin/env bash
# One of the back-to-back device calls of the reference drafter's GPU run (recipes/README.md, "On a GPU").
#
#   bash .gpuN/code/recipes/gpu_device_call.sh N [MINUTES]     # call N on the lent machine, in the repository copy
#
# Call N carries its share of the inputs as the repository's ignored folder .gpuN (recipes/gpu_stage.py pack cut
# them: call-1, call-2, call-3; all three are ready before the first call, so the calls follow each other at
# once), with this branch's changed sources under .gpuN/code, laid over the copy first.
# The pieces collect in /tmp/stage, outside the repository, which lasts while the machine is held.
#   1: the first pieces, and what the machine has (GPU, python packages);
#   2: the target's pieces and the data complete: install them, assemble the reference target and load it on
#      the GPU, check that the carried cache is the one it would write (same target fingerprint) and decode once;
#   3: the drafter complete: train (at most MINUTES of steps, default 5), measure held-out tau before and after,
#      and write the outputs to $OUT within the return limits (recipes/gpu_stage.py collect).
# WHEELS=1 installs the wheels in .gpuN/wheels first (transformers as tested here, if the machine's own failed
# in call 2).
set -uo pipefail
CALL=$1
MINUTES=${2:-5}
# Where things are there; a rehearsal on a CPU (tests/training/test_gpu_stage.py) points them elsewhere.
STAGE=${STAGE:-/tmp/stage}
SITE=${SITE:-/tmp/site}
RUN=${RUN:-/tmp/run}
DATA_ROOT=${DATA_ROOT:-/}  # the data unpacks at the absolute paths it had where it was packed
CACHE=${CACHE:-/tmp/vgpu/cache}
PROMPTS=${PROMPTS:-/tmp/vgpu/prompts/prompts.jsonl}
DEVICE=${DEVICE:-cuda}
TRAIN_EXTRA=${TRAIN_EXTRA:-}  # more train_qwen3vl.py options (a rehearsal's toy sizes)
# The reference target is assembled under VLMSPEC_CACHE: the carried cache names it by that path.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLMSPEC_CACHE=${VLMSPEC_CACHE:-/root/.cache/vlmspec}
export CACHE PROMPTS DEVICE
exec > >(tee -a "$OUT/log-$CALL.txt") 2>&1
echo "call $CALL at $(date -u +%T)"
CARRIED=.gpu$CALL
cp -r "$CARRIED/code/." .
python3 recipes/gpu_stage.py unpack --carried "$CARRIED" --stage "$STAGE" || exit 1
if [[ "${WHEELS:-0}" == 1 ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "$CARRIED"/wheels/*.whl || exit 1
fi
export PYTHONPATH="$SITE:$PWD"

case "$CALL" in
1)
  nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv
  python3 -c "import sys, torch, transformers, accelerate, tokenizers; print(sys.version.split()[0], torch.__version__, \
transformers.__version__, accelerate.__version__, tokenizers.__version__, torch.cuda.is_available())"
  python3 -c "import torchvision; print('torchvision', torchvision.__version__)"
  nproc; free -g | head -2; df -h /tmp | tail -1
  ;;
2)
  python3 recipes/gpu_stage.py install --stage "$STAGE" --site "$SITE" --root "$DATA_ROOT" --partial || exit 1
  python3 - <<'EOF'
import os
import time
started = time.perf_counter()
import torch
from vlmspec.engine import SpecEngine
from vlmspec.loading import load_target
from vlmspec.training import TargetCache, load_prompt_sources, split_prompts
from vlmspec.training.cache import target_fingerprint

device = torch.device(os.environ["DEVICE"])
target = load_target("reference", dtype="bfloat16" if device.type == "cuda" else "float32", device=device)
print(f"target loaded on {target.device} in {time.perf_counter() - started:.1f} s")
cache = TargetCache(os.environ["CACHE"])
print("carried cache matches the target:", cache.spec.target == target_fingerprint(target), len(cache), "sequences")
_, heldout = split_prompts(load_prompt_sources([os.environ["PROMPTS"]]), 8192, 16, 0)
tick = time.perf_counter()
result = SpecEngine(target).generate(heldout[0].images or None, messages=heldout[0].messages, max_new_tokens=32)
print(f"decoded {len(result.token_ids)} tokens in {time.perf_counter() - tick:.1f} s: {result.text[:80]!r}")
EOF
  ;;
3)
  python3 recipes/gpu_stage.py install --stage "$STAGE" --site "$SITE" --root "$DATA_ROOT" || exit 1
  # SECONDS_LEFT (the call's timeout less a margin) stops the run in time for collect to return what is written.
  # shellcheck disable=SC2086  # TRAIN_EXTRA is a list of options
  timeout --signal=INT "${SECONDS_LEFT:-100000}" python3 recipes/gpu_train_reference.py --target reference --prompts "$PROMPTS" --out "$RUN" --cache "$CACHE" \
      --init-from "$STAGE/files/drafter" --max-minutes "$MINUTES" -- --attention sdpa $TRAIN_EXTRA
  echo "training exited with $? at $(date -u +%T)"
  python3 recipes/gpu_stage.py collect --run "$RUN" --out "$OUT"
  ;;
esac
echo "call $CALL done at $(date -u +%T)"
