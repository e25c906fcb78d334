"""Episodes batched across a group: tokens/s of 8 calculator episodes rolled out together (every live episode's
turn in one batch of the engine) against the same 8 one at a time, on the calculator warm-up's champion.

    .venv/bin/python bench/agent_episodes.py [--base models:/smollm2-135m-calculator@champion]
        [--output ./runs/smollm2-135m-calculator] [--group 8] [--reps 3]

Both sides run the same episodes: a GRPO group (one held-out question of ladle://calculator-prompts-heldout, eight
episodes; ``--distinct``: eight different questions), temperature 1,
each turn's seed fixed by (episode, turn), so the engine draws the same tokens either way (checked). One thread
(torch's default here), float32, the model's tool calls run by the built-in calculator in one tool host. Throughput
is the model's tokens over the engine's seconds (the tool host's are reported beside).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save  # noqa: E402

from ladle.agents import environments, episodes  # noqa: E402
from ladle.agents.tool_host import ToolHost  # noqa: E402
from ladle.assets import resolve_builtin  # noqa: E402


def base_folder(base: str, output: str) -> str:
    if not base.startswith("models:/"):
        return base
    from ladle.config import build_config
    from ladle.plan.inputs import base_dir_of, registered_version

    cfg = build_config({"base": base, "data": {"path": "ladle://demo-prompts"}, "output": output}, [])
    return str(base_dir_of(cfg, registered_version(cfg)))


def main() -> None:
    import torch

    parser = arguments()
    parser.add_argument("--distinct", action="store_true", help="eight different questions, not one question's group")
    args = parser.parse_args()
    tokenizer, engine, rows, settings = setup(args.base, args.output, args.group, args.distinct)
    env = environments.load("calculator", {})
    runs: dict[str, list[dict]] = {"together": [], "one_at_a_time": []}
    with ToolHost(env, 10.0, 64) as host:
        for rep in range(args.reps):
            seed = partial(seed_of, rep)
            began = time.perf_counter()
            together, gen = episodes.run(engine, tokenizer, host, env, rows, settings, seed)
            wall = time.perf_counter() - began
            runs["together"].append(measure(together, gen, wall))
            alone, gen, began = [], 0.0, time.perf_counter()
            for k, row in enumerate(rows):
                (e,), g = episodes.run(engine, tokenizer, host, env, [row], settings, partial(alone_seed, rep, k))
                alone.append(e)
                gen += g
            wall = time.perf_counter() - began
            runs["one_at_a_time"].append(measure(alone, gen, wall))
            same = [a.ids == b.ids for a, b in zip(together, alone, strict=True)]
            for side in runs:
                r = runs[side][-1]
                print(
                    f"rep {rep} {side:<14} {r['tokens_per_s']:7.1f} model tok/s  {r['tokens']} tokens, "
                    f"{r['turns']} turns, {r['calls']} calls, engine {r['generation_s']:.2f} s, wall {r['wall_s']:.2f} s",
                    flush=True,
                )
            print(f"rep {rep} same tokens in {sum(same)}/{len(same)} episodes", flush=True)
    med = {side: statistics.median(r["tokens_per_s"] for r in runs[side]) for side in runs}
    summary = {
        "base": args.base,
        "group": args.group,
        "episodes": "distinct questions" if args.distinct else "one question's group",
        "median_model_tokens_per_s": med,
        "ratio": med["together"] / med["one_at_a_time"],
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(summary, indent=2))
    save("agent_episodes" + ("_distinct" if args.distinct else ""), {"summary": summary, "runs": runs})


def arguments() -> argparse.ArgumentParser:
    """The options both agent benches take: the model, where its registry is, the group and the reps."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", default="models:/smollm2-135m-calculator@champion")
    parser.add_argument("--output", default="./runs/smollm2-135m-calculator")
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    return parser


def setup(base: str, output: str, group: int, distinct: bool = False):
    """The model's tokenizer, an engine over it (float32, rows up to ``group``), the episodes' rows (a GRPO group:
    one held-out question ``group`` times; ``distinct``: that many different questions) and their settings."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ladle.serve.engine import Engine

    folder = base_folder(base, output)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    engine = Engine(model, tokenizer, "cpu", group, thread=False)
    lines = Path(resolve_builtin("ladle://calculator-prompts-heldout", "data.path")).read_text().splitlines()
    if distinct:
        rows = [{"prompt": json.loads(line)["prompt"], "columns": {}} for line in lines[:group]]
    else:
        rows = [{"prompt": json.loads(lines[0])["prompt"], "columns": {}}] * group
    settings = episodes.Settings(max_turns=3, max_completion_tokens=40, max_tool_result_tokens=64)
    return tokenizer, engine, rows, settings


def seed_of(rep: int, k: int, turn: int) -> int:
    return 1000 * rep + 10 * k + turn


def alone_seed(rep: int, k: int, _: int, turn: int) -> int:
    """Episode ``k``'s seeds when it runs alone (as episode 0)."""
    return seed_of(rep, k, turn)


def measure(done, generation_s: float, wall_s: float) -> dict:
    tokens = sum(e.model_tokens for e in done)
    return {
        "tokens": tokens,
        "turns": sum(e.turns for e in done),
        "calls": sum(e.calls for e in done),
        "ended": [e.ended for e in done],
        "generation_s": generation_s,
        "wall_s": wall_s,
        "tokens_per_s": tokens / generation_s,
    }


if __name__ == "__main__":
    main()
