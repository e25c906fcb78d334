"""The general-ability probe during GRPO: the live policy asked ``eval.probe``'s questions every
``training.rl.probe_every`` steps, so a run that is learning its reward by forgetting what the model knew shows it
as it happens, and is not allowed to end that way silently.

Online RL moves the policy wherever its reward pays, and nothing in the reward says "keep answering everything
else": on the real SmolLM2 the shipped recipe's probe fell 0.69 -> 0.19 at the end while the reward rose, and a
user's one-line reward took it to 0.00. The evaluation stage's gate then refuses the model, after the whole run.
Here the same questions are asked on the engine that samples the rollouts (greedy, the probe's own token budget,
the marks the gate uses), and:

- every check is logged (MLflow ``probe``, the step events) and the trend is in the run's report;
- ``training.rl.probe_guard: restore`` (the default, with ``promote.max_probe_drop`` set): a check that finds the
  probe more than ``max_probe_drop`` below where it started ends the run with the trainable weights of the last
  check that was within it, the breach and the step kept said in the report. Where those weights are not whole on
  each rank (ZeRO-3, FSDP2, tensor or pipeline sharding) or are the whole model (a full fine-tune, whose copy would
  double the weights' memory), the run ends at the breach instead, saying so: the gate then refuses it;
- ``report``: checked and reported only.

Decided here, not in the gate, because only training has the weights of every step: the gate can refuse a model,
but only this can hand back the one before it forgot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ladle.data.probe import answered, load_probe
from ladle.serve.rows import Job
from ladle.train import common

WHOLE_ON_EACH_RANK = frozenset({"ddp", "zero1", "zero2"})


@dataclass
class ProbeWatch:
    """The probe's questions as token ids, its trend so far, and the weights of the last check within bounds."""

    rows: list[dict]  # {"ids", "answers"}
    max_new_tokens: int
    every: int
    max_drop: float | None
    guard: str  # restore | report
    restorable: bool
    trend: list[tuple[int, float]] = field(default_factory=list)
    kept: dict[str, torch.Tensor] | None = None
    kept_step: int | None = None
    breach: str | None = None

    @property
    def start(self) -> float:
        return self.trend[0][1] if self.trend else math.nan

    def summary(self) -> dict:
        """What the report says of the probe during training."""
        out: dict = {"probe_trend": [[step, score] for step, score in self.trend]}
        if self.breach:
            out["probe_guard"] = self.breach
        return out


def watch_for(cfg, tokenizer, strategy: str) -> ProbeWatch | None:
    """The probe to watch during this run, or None (no ``eval.probe``, or ``training.rl.probe_every: 0``)."""
    rl = cfg.training.rl
    if cfg.eval.probe is None or rl.probe_every == 0:
        return None
    rows = []
    for question in load_probe(cfg.eval.probe):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": question["question"]}], add_generation_prompt=True, tokenize=True
        )
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        rows.append({"ids": list(ids), "answers": question["answers"]})
    restorable = cfg.training.lora.enabled and strategy in WHOLE_ON_EACH_RANK
    return ProbeWatch(
        rows, cfg.eval.probe_max_new_tokens, rl.probe_every, cfg.promote.max_probe_drop, rl.probe_guard, restorable
    )


def score(s, watch: ProbeWatch, sampling) -> float:
    """The fraction of the probe the live policy answers right (greedy; every rank's share gathered). Collective.

    Args:
        sampling: the context the rollouts sample in (whole weights, merged adapters), entered on every rank.
    """
    from accelerate.utils import gather_object

    acc = s.accelerator
    mine = watch.rows[acc.process_index :: acc.num_processes]
    jobs = [Job(ids=list(row["ids"]), max_new_tokens=watch.max_new_tokens) for row in mine]
    with sampling():
        s.policy.eval()
        s.engine.run(jobs)
        s.policy.train()
    marks = [
        answered(s.tokenizer.decode(job.tokens, skip_special_tokens=True), row["answers"])
        for job, row in zip(jobs, mine, strict=True)
    ]
    every = gather_object([marks]) if acc.num_processes > 1 else [marks]
    flat = [m for part in every for m in part]
    return round(sum(flat) / len(flat), 4) if flat else math.nan


def trainable(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in policy.named_parameters() if p.requires_grad}


def check(s, watch: ProbeWatch, step: int, sampling) -> bool:
    """Score the probe after ``step`` steps and record it; True when the run must end here (the guard found it
    fallen past ``max_drop``; the weights kept, where they can be, are back in the policy). Collective."""
    value = score(s, watch, sampling)
    watch.trend.append((step, value))
    s.log({"probe": value}, step)
    common.emit(s.accelerator, "probe", step=step, score=value, start=watch.start)
    floor = watch.start - watch.max_drop if watch.max_drop is not None else -math.inf
    if value >= floor:
        if watch.guard == "restore" and watch.restorable and watch.max_drop is not None:
            watch.kept, watch.kept_step = trainable(s.policy), step
        return False
    if watch.guard != "restore":
        return False
    fell = f"the probe fell to {value} at step {step}, more than promote.max_probe_drop = {watch.max_drop} below {watch.start}"
    if watch.kept is not None:
        with torch.no_grad():
            for name, p in s.policy.named_parameters():
                if name in watch.kept:
                    p.copy_(watch.kept[name])
        watch.breach = f"{fell}: the run ended there, with the adapter of step {watch.kept_step} (probe {dict(watch.trend)[watch.kept_step]})"
    else:
        watch.breach = (
            f"{fell}: the run ended there with those weights (a copy of them to go back to is kept for LoRA under "
            "ddp, zero1 or zero2 only); the promotion gate will refuse them"
        )
    return True
