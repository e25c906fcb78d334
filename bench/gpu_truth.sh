#!/usr/bin/env bash
# The GPU-truth run on one bare CUDA machine without a package registry (what bench/RESULTS.md's GPU section
# records): installs the wheels carried in .whl/ beside the image's torch, then, each phase bounded in time,
#   1. `pytest -m gpu` beside bench/gpu_truth.py's strategy rows (each process's CUDA peak is its own);
#   2. the 8B LoRA throughput run, alone on the GPU;
#   3. ladle's server on the merged model the pipeline test wrote.
# Everything lands in $OUT (default bench/out/gpu). A rerun of part of it: TESTS (pytest -k), ROWS (strategy row
# labels, comma-separated), THROUGHPUT=0 (no 8B run).
set -u
OUT=${OUT:-bench/out/gpu}
mkdir -p "$OUT" /tmp/pt
export PYTHONUNBUFFERED=1 PREFECT_SERVER_ANALYTICS_ENABLED=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > "$OUT/env.txt" 2>&1 \
    || { tail "$OUT/env.txt"; echo "ladle install failed"; exit 1; }
{ nvidia-smi; python3 -c 'import sys, torch; print(sys.version, torch.__version__, torch.version.cuda)'; } >> "$OUT/env.txt" 2>&1
ladle plan recipes/tiny-cpu.yaml --gpus auto >> "$OUT/env.txt" 2>&1
timeout "${PYTEST_S:-270}" python3 -m pytest -m gpu tests/gpu -p no:cacheprovider -v -rfEs --durations=0 \
    -k "${TESTS:-}" --basetemp /tmp/pt > "$OUT/pytest.log" 2>&1 &
tests=$!
timeout "${STRATEGIES_S:-270}" python3 bench/gpu_truth.py --phases strategies --only "${ROWS:-}" --out "$OUT" \
    > "$OUT/strategies.log" 2>&1
wait $tests
echo "pytest exit $?"
if [ "${THROUGHPUT:-1}" = 1 ]; then
    timeout "${THROUGHPUT_S:-150}" python3 bench/gpu_truth.py --phases throughput --out "$OUT/t" > "$OUT/throughput.log" 2>&1
fi
merged=$(find /tmp/pt -path '*merged/config.json' | head -1)
if [ -n "$merged" ]; then
    timeout "${SERVE_S:-70}" python3 bench/gpu_truth.py --phases serve --serve-model "$(dirname "$merged")" \
        --out "$OUT/s" > "$OUT/serve.log" 2>&1
else
    echo "no merged model under /tmp/pt: the pipeline test did not get that far" | tee "$OUT/serve.log"
fi
grep -E "PASSED|FAILED|ERROR|SKIPPED" "$OUT/pytest.log" | tail -n 30
python3 bench/gpu_truth.py --summary "$OUT/gpu_truth.json" "$OUT/t/gpu_truth.json" "$OUT/s/gpu_truth.json"
