"""A GGUF base's conversion with each file parsed once (``ladle.assets.gguf.parsed_once``, as ``converted`` runs
it) vs the same steps without it (transformers parsing the file for each stage and rebuilding gguf's tensor-name
map per tensor), side by side, alternating, on SmolLM2-135M-Instruct's shipped file.

    .venv/bin/python bench/gguf_convert.py [--reps 2] [--dtype float32]

Reported: CPU seconds of the check and the conversion (this process), and whether both wrote the same weights.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save  # noqa: E402

from ladle.assets.gguf import check_file, parsed_once, shipped_smollm2, write_folder  # noqa: E402


def once(path: Path, dtype: str, reuse: bool) -> dict:
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:
        began = time.process_time()
        with parsed_once() if reuse else contextlib.nullcontext():
            check_file(path, str(path))
            write_folder(path, Path(tmp) / "out", dtype)
        cpu = time.process_time() - began
        weights = load_file(str(Path(tmp) / "out" / "model.safetensors"))
        digest = hashlib.sha256(b"".join(weights[k].numpy().tobytes() for k in sorted(weights))).hexdigest()
    return {"cpu_s": cpu, "weights_sha256": digest}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    path = Path(shipped_smollm2())
    runs: dict[str, list[dict]] = {"each stage parses": [], "parsed once": []}
    for _ in range(args.reps):
        for name in runs:
            runs[name].append(once(path, args.dtype, reuse=name == "parsed once"))
            print(name, runs[name][-1], flush=True)
    med = {name: statistics.median(r["cpu_s"] for r in rows) for name, rows in runs.items()}
    same = len({r["weights_sha256"] for rows in runs.values() for r in rows}) == 1
    row = {
        "each_stage_parses_cpu_s": round(med["each stage parses"], 2),
        "parsed_once_cpu_s": round(med["parsed once"], 2),
        "cpu_ratio": round(med["parsed once"] / med["each stage parses"], 3),
        "same_weights": same,
    }
    print(row)
    print(save("gguf_convert", {"reps": args.reps, "dtype": args.dtype, "model": path.name, **row}))


if __name__ == "__main__":
    main()
