#!/usr/bin/env bash
# Builds .gpu/train-site.tar.xz: every package bench/gpu_train.sh needs beyond the GPU image's torch (Python 3.12,
# no package registry there), unpacked and compressed as one solid xz archive so the set fits the 64 MiB a device
# call carries (the wheels as zips are ~85 MB; pyarrow's Flight and test files are left out, which
# neither ladle's packed data nor the datasets library's JSON loading import). Versions are this checkout's.
#     PY=.venv/bin/python bash bench/gpu_train_carry.sh          (~2 min on 2 cores)
set -eu
PY=${PY:-.venv/bin/python}
out=.gpu/train-site.tar.xz
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
plat="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
pins=$("$PY" - <<'PY'
from importlib.metadata import version
names = """transformers accelerate peft trl datasets pyarrow pandas dill multiprocess xxhash liger-kernel pydantic
pydantic-core annotated-types typing-inspection typing-extensions fsspec psutil pyyaml regex safetensors tokenizers
huggingface-hub hf-xet filelock tqdm packaging httpx httpcore httpx2 httpcore2 truststore h11 anyio sniffio idna certifi click rich markdown-it-py
mdurl pygments python-dateutil six urllib3 tzdata shellingham typer annotated-doc""".split()
pinned = {"liger-kernel": "0.8.5"}  # not a dependency of ladle here (Triton kernels, CUDA only)
print(" ".join(f"{n}=={pinned.get(n) or version(n)}" for n in names))
PY
)
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat -d "$tmp/whl" $pins
mkdir "$tmp/site"
for w in "$tmp"/whl/*.whl; do "$PY" -m zipfile -e "$w" "$tmp/site" >/dev/null; done
rm -rf "$tmp"/site/pyarrow/*flight* "$tmp"/site/pyarrow/tests "$tmp"/site/pandas/tests \
    "$tmp"/site/pyarrow/include "$tmp"/site/pyarrow/src
mkdir -p .gpu
tar -C "$tmp/site" -cf - . | xz -T2 -6 > "$out"
ls -la "$out"
