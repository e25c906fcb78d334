#!/usr/bin/env bash
# The serving check on one bare CUDA machine without a package registry (issue: the champion served on the GPU).
# Prepare here, once:   PY=$PWD/.venv/bin/python ../shared/gpu/make-carry.sh .gpu && bash bench/gpu_serve.sh --carry
#   (adds the few wheels ladle's server needs beyond make-carry's serving set to .gpu/whl)
# Run there (carry .gpu): bash bench/gpu_serve.sh        -- every phase bounded; results in $OUT/gpu_serve.json
#   Through the device tool: carry .gpu/whl and .gpu/dskernels-lite.tar.xz, run OUT=/tmp/gs bash bench/gpu_serve.sh, then
#   copy /tmp/gs/{gpu_serve.json,log.txt,ops.txt,env.txt,server-*.log,summary.txt} to the tool's $OUT (the model
#   folder has too many files to come back). About 4-7 minutes on an H200, the op build (155-231 s) included.
set -u
OUT=${OUT:-bench/out/gpu-serve}
if [ "${1:-}" = "--carry" ]; then
    PY=${PY:-.venv/bin/python}
    plat="--platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat -d .gpu/whl \
        prometheus-client==0.26.0 psutil==7.2.2 fsspec==2026.9.0 pyyaml==6.0.3 h11==0.16.0 click==8.5.1 \
        anyio==4.16.0 sniffio==1.3.1 idna==3.20 \
        llguidance==1.9.1 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 \
        setproctitle==1.3.8
    du -sh .gpu
    exit 0
fi
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl || { echo "wheels failed"; exit 1; }
python3 -c "import tarfile; tarfile.open('.gpu/dskernels-lite.tar.xz').extractall('/tmp/site', filter='data')"
export PYTHONPATH=/tmp/site:. PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/ext
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}   # as the image sets it: ladle must cope
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c 'import sys, torch, transformers, deepspeed, mii; print(sys.version.split()[0], torch.__version__, transformers.__version__, deepspeed.__version__, mii.__version__)'
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
run() { [ "$1" -gt 0 ] || return 0   # a limit of 0 skips the phase (a rerun of the others)
    timeout "$1" python3 bench/gpu_serve.py --out "$OUT" --phases "$2" --load-s "${LOAD_S:-12}" >> "$OUT/log.txt" 2>&1 \
        || echo "phase $2 ended with $?" | tee -a "$OUT/log.txt"; }
# Nothing timed runs beside FastGen's op build: built in the background while offline generate and the transformers
# backend were measured (2026-11-28), it took their CPU (offline generate 15.6-28.4 tokens/s on an H200). So: the
# references first, then the build alone (timed; ladle's own prebuild then loads the ops from TORCH_EXTENSIONS_DIR),
# then each backend with the machine to itself.
run ${OFFLINE_S:-60} model,offline
timeout 300 python3 -c 'from ladle.serve import fastgen; print(f"FastGen ops built in {fastgen.prebuild_ops(290):.1f} s")' \
    > "$OUT/ops.txt" 2>&1 || echo "ops prebuild ended with $?" >> "$OUT/ops.txt"
cat "$OUT/ops.txt"
run ${MII_S:-150} mii          # MII's start (~45-57 s) included
run ${PIPELINE_S:-90} pipeline
run ${TRANSFORMERS_S:-100} transformers
nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv >> "$OUT/log.txt"
python3 bench/gpu_serve.py --out "$OUT" --summary | tee "$OUT/summary.txt"
