#!/usr/bin/env bash
# bench/gpu_train.py on one bare CUDA machine without a package registry: unpacks .gpu/train-site.tar.xz (built
# here by bench/gpu_train_carry.sh) beside the image's torch, then runs each phase as its own process under its
# own time limit, the 8B model written once and shared. Everything lands in $OUT (default bench/out/gpu-train).
#     bash bench/gpu_train.sh            (PHASES, STEPS and the *_S limits override the defaults)
set -u
OUT=${OUT:-bench/out/gpu-train}
WORK=${WORK:-/tmp/ladle-gpu-train}
mkdir -p "$OUT" /tmp/site "$WORK"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 TOKENIZERS_PARALLELISM=false
began=$(date +%s)
tar -C /tmp/site -xJf .gpu/train-site.tar.xz || { echo "unpacking the site failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi; python3 -c 'import sys, torch, transformers, trl, peft, liger_kernel; print(sys.version, torch.__version__, torch.version.cuda, transformers.__version__, trl.__version__, peft.__version__)'; } > "$OUT/env.txt" 2>&1
tail -1 "$OUT/env.txt"
echo "site ready after $(( $(date +%s) - began )) s"
run() {  # phase, limit in seconds
    timeout -k 10 "$2" python3 bench/gpu_train.py --phases "$1" --steps "${STEPS:-8}" --work "$WORK" --out "$OUT" \
        > "$OUT/$1.log" 2>&1
    echo "phase $1: exit $? after $(( $(date +%s) - began )) s"
    grep -E "^  (throughput|trl|trl-dpo|dpo|strategies)" "$OUT/$1.log" | cut -c1-900
}
# Default: what fits one device call (≤ 9 min): the 8B SFT row beside TRL's (2026-11-28: 163 s with the model's
# writing), then the 8B DPO row beside TRL's DPOTrainer. PHASES="strategies" runs the 0.73B strategies, DPO included
# (four rows, about 230 s), "ladle8b-plain" the fast paths' share; ROWS and EXTRA_SETS pick rows and settings.
for phase in ${PHASES:-ladle8b trl8b dpo8b trldpo8b}; do
    case $phase in
        ladle8b) run ladle8b "${LADLE_S:-230}" ;;
        trl8b) run trl8b "${TRL_S:-150}" ;;
        dpo8b) run dpo8b "${DPO_S:-150}" ;;
        trldpo8b) run trldpo8b "${TRLDPO_S:-150}" ;;
        ladle8b-plain) run ladle8b-plain "${PLAIN_S:-80}" ;;
        strategies) run strategies "${STRATEGIES_S:-150}" ;;
    esac
done
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
