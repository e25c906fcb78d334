"""One token drawn from a row's probabilities: ladle's inverse-distribution draw (``ladle.serve.rows.draw``)
against ``torch.multinomial``, per call on one CPU thread, at the vocabulary sizes of the tiny model, SmolLM2 and
Llama 3.

    .venv/bin/python bench/draw.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save  # noqa: E402

from ladle.serve.rows import draw  # noqa: E402


def per_call_us(fn, calls: int) -> float:
    fn()
    began = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - began) / calls * 1e6


def main() -> None:
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    rows = []
    for vocab in (345, 32000, 49152, 128256):
        probs = torch.softmax(torch.randn(vocab, generator=generator), dim=-1)
        ladle = per_call_us(lambda p=probs: draw(p, generator), 1000)
        peer = per_call_us(lambda p=probs: torch.multinomial(p, 1, generator=generator), 300)
        rows.append({"vocab": vocab, "draw_us": ladle, "multinomial_us": peer, "speedup": peer / ladle})
        print(f"vocab {vocab:>7}: draw {ladle:7.0f} us  multinomial {peer:7.0f} us  {peer / ladle:5.1f}x", flush=True)
    print("saved", save("draw", {"rows": rows}))


if __name__ == "__main__":
    main()
