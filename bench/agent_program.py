"""What an agent program costs against ladle's in-process environment: the same calculator episodes, played by
ladle's environment in its tool host and by an OpenAI SDK program over HTTP against the endpoint of the policy
(``ladle.agents.builtin.calculator_agent`` through ``ladle.agents.programs``), on the calculator warm-up's champion.

    .venv/bin/python bench/agent_program.py [--base models:/smollm2-135m-calculator@champion]
        [--output ./runs/smollm2-135m-calculator] [--group 8] [--reps 3]

Both sides run one GRPO group (one held-out question of ladle://calculator-prompts-heldout, eight episodes),
temperature 1, each turn's seed fixed by (episode, turn), every turn batched: the engine draws the same tokens
either way (checked, with the masks). Throughput is the model's tokens over the wall time of the whole batch of
episodes (for the program: its process's start, the HTTP calls and the batching window included). One thread
(torch's default here), float32.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_episodes import arguments, measure, seed_of, setup  # noqa: E402
from common import save  # noqa: E402

from ladle.agents import environments, episodes, programs  # noqa: E402
from ladle.agents.tool_host import ToolHost  # noqa: E402


def main() -> None:
    import torch

    args = arguments().parse_args()
    tokenizer, engine, rows, settings = setup(args.base, args.output, args.group)
    env = environments.load("calculator", {})
    program = environments.load("calculator-agent", {})  # ladle.agents.builtin.calculator_agent
    runs: dict[str, list[dict]] = {"environment": [], "program": []}
    with ToolHost(env, 10.0, 64) as host, programs.Endpoint(60) as endpoint:
        for rep in range(args.reps):
            seed = partial(seed_of, rep)
            began = time.perf_counter()
            hosted, gen = episodes.run(engine, tokenizer, host, env, rows, settings, seed)
            runs["environment"].append(measure(hosted, gen, time.perf_counter() - began))
            began = time.perf_counter()
            played, gen = programs.run(engine, tokenizer, endpoint, program, rows, settings, seed, timeout_s=300)
            runs["program"].append(measure(played, gen, time.perf_counter() - began))
            same = [a.ids == b.ids and a.mask == b.mask for a, b in zip(hosted, played, strict=True)]
            for side in runs:
                r = runs[side][-1]
                print(
                    f"rep {rep} {side:<12} {r['tokens'] / r['wall_s']:7.1f} model tok/s (wall)  {r['tokens']} tokens, "
                    f"{r['turns']} turns, {r['calls']} calls, engine {r['generation_s']:.2f} s, wall {r['wall_s']:.2f} s",
                    flush=True,
                )
            print(f"rep {rep} same tokens and masks in {sum(same)}/{len(same)} episodes", flush=True)
    med = {side: statistics.median(r["tokens"] / r["wall_s"] for r in runs[side]) for side in runs}
    overhead = {side: statistics.median(r["wall_s"] - r["generation_s"] for r in runs[side]) for side in runs}
    summary = {
        "base": args.base,
        "group": args.group,
        "median_model_tokens_per_wall_s": med,
        "ratio_program_to_environment": med["program"] / med["environment"],
        "median_seconds_outside_the_engine": overhead,
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(summary, indent=2))
    save("agent_program", {"summary": summary, "runs": runs})


if __name__ == "__main__":
    main()
