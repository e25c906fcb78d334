"""Peak memory of the prepare stage when the input is far larger than what it keeps in memory.

    .venv/bin/python bench/prepare_memory.py [--small 50000] [--large 1000000]

Each measurement is a fresh `ladle data prepare` process; its peak RSS comes
from the kernel (ru_maxrss of the child). If preparation streams, peak RSS on
the large file stays close to that on the small one although the input is
~10x larger. A baseline process that loads the large file's records into a
list (what a non-streaming reader holds) is measured beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LOAD_ALL = "import json,sys; rows=[json.loads(l) for l in open(sys.argv[1])]; print(len(rows))"


def write(path: Path, rows: int) -> int:
    from ladle.assets.demo import demo_rows

    block = demo_rows(n=10_000, seed=3)
    with path.open("w") as fh:
        for i in range(rows):
            row = dict(block[i % len(block)])
            row["input"] = f"{row['input']} {i}".strip()  # every record distinct
            fh.write(json.dumps(row) + "\n")
    return path.stat().st_size


# A wrapper process per measurement: its RUSAGE_CHILDREN covers exactly one child.
WRAP = (
    "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL, "
    "stderr=subprocess.DEVNULL); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
)


def peak_rss_mib(argv: list[str]) -> tuple[float, float]:
    """Run ``argv`` to completion; return (its peak RSS in MiB, wall seconds)."""
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", WRAP, *argv], check=True, capture_output=True, text=True)
    return int(done.stdout.strip()) / 1024, time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", type=int, default=50_000)
    parser.add_argument("--large", type=int, default=500_000)
    args = parser.parse_args()
    ladle = str(Path(sys.executable).with_name("ladle"))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name, rows in (("small", args.small), ("large", args.large)):
            data = tmp / f"{name}.jsonl"
            size = write(data, rows)
            rss, wall = peak_rss_mib(
                [
                    ladle,
                    "data",
                    "prepare",
                    str(ROOT / "recipes" / "tiny-cpu.yaml"),
                    "--json",
                    "--set",
                    f"data.path={data}",
                    "--set",
                    f"output={tmp / name}",
                ]
            )
            results[name] = {"rows": rows, "file_mib": size / 2**20, "peak_rss_mib": rss, "wall_s": wall}
            print(
                f"ladle prepare {name:<5} {rows:>9,} rows {size / 2**20:8.1f} MiB file  peak RSS {rss:8.1f} MiB  {wall:6.1f} s",
                flush=True,
            )
        rss, wall = peak_rss_mib([sys.executable, "-c", LOAD_ALL, str(tmp / "large.jsonl")])
        results["load_all_baseline"] = {"rows": args.large, "peak_rss_mib": rss, "wall_s": wall}
        print(f"baseline: records of the large file in a list: peak RSS {rss:8.1f} MiB", flush=True)
    growth = results["large"]["peak_rss_mib"] / results["small"]["peak_rss_mib"]
    print(
        f"input grew {results['large']['file_mib'] / results['small']['file_mib']:.1f}x; ladle peak RSS grew {growth:.2f}x"
    )
    print("saved", save("prepare_memory", {"results": results, "rss_growth": growth}))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
