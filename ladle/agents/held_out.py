"""Held-out episodes outside training (the evaluate stage's): greedy, on a merged model, through a tool host
made for the call, or an agent program's endpoint."""

from __future__ import annotations

from ladle.agents import programs
from ladle.agents.environments import Environment
from ladle.agents.episodes import Settings, run
from ladle.agents.tool_host import ToolHost


def play(model, tokenizer, device, rows: list[dict], env: Environment, settings: Settings, ep, batch: int):
    """One greedy episode per row on ``model`` (the evaluation's: a merged model outside training), its own engine
    and tool host (an agent program's endpoint) made for the call and closed after (``ep``:
    ``training.rl.episode``)."""
    from ladle.serve.engine import Engine

    engine = Engine(model, tokenizer, str(device), batch, thread=False)
    if env.program:
        with programs.Endpoint(wait_s=ep.program_timeout_s) as endpoint:
            done, _ = programs.run(engine, tokenizer, endpoint, env, rows, settings, None, 0, ep.program_timeout_s)
        return done
    with ToolHost(env, ep.tool_timeout_s, ep.max_tool_result_tokens) as host:
        done, _ = run(engine, tokenizer, host, env, rows, settings, None)
    return done
