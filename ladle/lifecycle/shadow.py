"""Shadow evaluation (``promote.shadow``): before a challenger takes any live traffic, it answers a replay of the
champion's last captured requests, and promotion waits on a paired test of the two on those same requests.

The challenger is asked on the deploy stage's own server (the served path: the same chat template, engine and
sampling code that will answer users), each request exactly as the champion got it: its messages, tools and
sampling settings (temperature, top_p, max_tokens, stop, seed). Nothing of it is captured.

What is scored (``eval.metric: exact_match``, the recipe's scorer): a request has a reference where its user said
what the right answer was, a correction, or approved the champion's answer (a thumbs up or a good score: that
answer is the reference). On those, the champion is right or wrong by its logged answer, the challenger by its
replayed one, and the test is McNemar's exact test on the discordant pairs, one-sided: the probability of the
challenger losing at least as many as it did were the two equally good. Requests nobody judged still count in the
agreement (the share of answers equal to the champion's) and in the worst-regressed list when scored.

The threshold: a challenger regresses when its success rate is below the champion's by more than
``promote.shadow.max_regression`` and more than the run-to-run spread measured on this replay (a sampled request
is replayed twice: the challenger's own difference between the two passes is the noise any comparison carries;
greedy requests have none), and that loss is significant (p below ``promote.shadow.alpha``). A regression holds
promotion back, naming the worst requests with both answers. A challenger better by more than the threshold,
significantly (the same test the other way), is promoted even where the held-out task metric only held (it may
not get worse): what users corrected is the truest held-out set there is, and a task at its ceiling cannot rise.
"""

from __future__ import annotations

import json
import math
from typing import Literal

import httpx
from pydantic import BaseModel, Field

from ladle.data import capture_files
from ladle.errors import LadleError


class Replayed(BaseModel):
    """One replayed request: what was asked, the reference where a user gave one, and both answers."""

    id: str
    prompt: str
    reference: str | None = None
    champion: str
    challenger: str
    champion_ok: bool | None = None
    challenger_ok: bool | None = None
    champion_reward: float | None = None
    challenger_reward: float | None = None


class ShadowResult(BaseModel):
    champion_version: str | None = Field(None, description="The champion whose traffic was replayed.")
    scorer: Literal["exact_match", "reward"] = Field("exact_match", description="eval.metric: how answers were scored.")
    requests: int = Field(description="Captured requests replayed to the challenger.")
    scored: int = Field(description="Of them, those with a reference (a correction or an approved answer).")
    champion: float | None = Field(
        None, description="The champion's success rate (exact_match) or mean reward (reward) on the scored requests."
    )
    challenger: float | None = Field(None, description="The challenger's, on the same requests.")
    difference: float | None = Field(None, description="challenger - champion (positive: better).")
    wins: int = Field(0, description="Scored requests the challenger got right and the champion wrong.")
    losses: int = Field(0, description="Scored requests the champion got right and the challenger wrong.")
    p_value: float | None = Field(
        None,
        description="One-sided p of the challenger being worse by chance: McNemar's exact test (exact_match), a "
        "paired sign-flip test of the reward differences (reward).",
    )
    p_better: float | None = Field(None, description="The same for the wins: p of winning this many by chance.")
    spread: float = Field(0.0, description="The challenger's success-rate difference between two replays.")
    threshold: float = Field(description="The drop allowed: max(promote.shadow.max_regression, spread).")
    agreement: float = Field(description="Share of replayed answers equal to the champion's.")
    regressed: bool
    improved: bool = Field(False, description="Better by more than the threshold, and significantly (p_better).")
    reason: str
    worst: list[Replayed] = Field(default_factory=list, description="Requests the challenger lost, both answers.")


class ShadowPlan(BaseModel):
    """What the deploy stage replays (``promote.shadow``), resolved by the flow: whose traffic and where."""

    traffic_url: str
    champion_name: str
    champion_version: str | None
    requests: int
    max_regression: float
    alpha: float
    good_score: float
    scorer: Literal["exact_match", "reward"] = "exact_match"
    rewards: dict | None = None  # scorer reward: the run's ``ladle.rewards.RewardSet`` (its fields)
    tokenizer_dir: str | None = None  # scorer reward: the completions' token ids, for rewards that read them

    def check(self, url: str, name: str, headers: dict) -> dict | None:
        result = shadow_check(url, name, headers, **self.model_dump())
        return None if result is None else result.model_dump()


def mcnemar_p(wins: int, losses: int) -> float:
    """One-sided exact McNemar: P(X >= losses), X ~ Binomial(wins + losses, 1/2)."""
    n = wins + losses
    if n == 0:
        return 1.0
    return min(1.0, sum(math.comb(n, k) for k in range(losses, n + 1)) / 2**n)


def last_requests(url: str, model: str, version: str | None, k: int) -> list[tuple[dict, dict | None]]:
    """The newest ``k`` captured chat requests ``model`` answered (its ``version``'s where it has any, any version
    otherwise), each with its latest feedback, oldest first. Files are read newest first, until ``k`` are found."""

    def newest(wanted_version: str | None) -> list[dict]:
        found: list[dict] = []
        for lines in capture_files.newest_files(url, "captures"):
            for line in reversed(lines):
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if record.get("route") != "chat" or record.get("model") != model:
                    continue
                if wanted_version is None or record.get("version") == wanted_version:
                    found.append(record)
                    if len(found) == k:
                        return found[::-1]
        return found[::-1]

    taken = newest(str(version)) if version is not None else []
    taken = taken or newest(None)
    feedback = {f["response_id"]: f for f in capture_files.read_records(url, "feedback") if "response_id" in f}
    return [(r, feedback.get(r.get("id"))) for r in taken]


def reference_of(record: dict, said: dict | None, good_score: float) -> str | None:
    """A user's correction, or the champion's answer where a user approved it; None: nobody said."""
    if said is None:
        return None
    correction = said.get("correction")
    if isinstance(correction, str) and correction.strip():
        return correction
    value = said.get("value")
    good = bool(value) if isinstance(value, bool) else isinstance(value, int | float) and value >= good_score
    return (record.get("answer") or {}).get("content") if good else None


def ask(client: httpx.Client, url: str, name: str, request: dict, seed_offset: int) -> str:
    """The challenger's answer to a captured request, sent as it was (a sampled one with a seed, so a second pass
    differs only by the seed)."""
    body = {**request, "model": name, "stream": False, "n": 1}
    if body.get("temperature", 1.0) and seed_offset:
        body["seed"] = int(body.get("seed") or 0) + seed_offset
    reply = client.post(f"{url}/v1/chat/completions", json=body)
    if 400 <= reply.status_code < 500 and reply.status_code != 429:
        # Refused (a limit the champion's server did not have, say): the challenger gave no answer to it.
        return f"[refused: HTTP {reply.status_code}]"
    if reply.status_code != 200:
        raise LadleError(f"shadow replay: the challenger's server answered {reply.status_code}: {reply.text[:300]}")
    message = reply.json()["choices"][0]["message"]
    text = message.get("content") or ""
    if message.get("tool_calls"):
        text += json.dumps([c["function"] for c in message["tool_calls"]], sort_keys=True)
    return text


def logged_answer(record: dict) -> str:
    answer = record.get("answer") or {}
    text = answer.get("content") or ""
    if answer.get("tool_calls"):
        text += json.dumps([c["function"] for c in answer["tool_calls"]], sort_keys=True)
    return text


def same(a: str, b: str) -> bool:
    return a.strip() == b.strip()


def success(rows: list[Replayed], answers: list[str]) -> float:
    scored = [(r, a) for r, a in zip(rows, answers, strict=True) if r.reference is not None]
    return sum(same(a, r.reference) for r, a in scored) / max(1, len(scored))


def shadow_check(
    url: str,
    name: str,
    headers: dict,
    traffic_url: str,
    champion_name: str,
    champion_version: str | None,
    requests: int,
    max_regression: float,
    alpha: float,
    good_score: float,
    scorer: str = "exact_match",
    rewards: dict | None = None,
    tokenizer_dir: str | None = None,
    timeout_s: float = 60.0,
) -> ShadowResult | None:
    """Replay the champion's last ``requests`` captured requests to the challenger's server at ``url`` and
    compare (see the module's text); None when the champion has no captured request to replay."""
    taken = last_requests(traffic_url, champion_name, champion_version, requests)
    if not taken:
        return None
    rows: list[Replayed] = []
    sampled = False
    with httpx.Client(headers={**headers, capture_files.INTERNAL_HEADER: "1"}, timeout=timeout_s) as client:
        for record, said in taken:
            request = record.get("request") or {}
            sampled |= bool(request.get("temperature", 1.0))
            prompt = next(
                (m.get("content") for m in reversed(request.get("messages", [])) if m.get("role") == "user"), ""
            )
            rows.append(
                Replayed(
                    id=record.get("id", ""),
                    prompt=str(prompt)[:500],
                    reference=reference_of(record, said, good_score),
                    champion=logged_answer(record),
                    challenger=ask(client, url, name, request, 0),
                )
            )
        second = [ask(client, url, name, r.get("request") or {}, 1) for r, _ in taken] if sampled else None
    common = {"champion_version": champion_version, "max_regression": max_regression, "alpha": alpha}
    if scorer == "reward":
        messages = [(r.get("request") or {}).get("messages", []) for r, _ in taken]
        return by_reward(rows, second, messages, rewards or {}, tokenizer_dir, **common)
    return by_exact_match(rows, second, **common)


def settle(
    rows: list[Replayed],
    scored: list[Replayed],
    scores: tuple[float, float] | None,
    tests: tuple[int, int, float, float],
    spread: float,
    common: dict,
    worst: list[Replayed],
    words: dict[str, str],
) -> ShadowResult:
    """The shared verdict: regressed (worse by more than the threshold, and significantly: ``p_worse`` below
    alpha), better (the same the other way), or neither. ``scores``: the champion's and the challenger's figure on
    the scored requests (None: none scored); ``tests``: (wins, losses, p_worse, p_better); ``words``: what the
    requests were scored by (``by``), what none scored means (``none``), the test (``test``), how a figure is
    written (``figure``)."""
    threshold = max(common["max_regression"], spread)
    agreement = sum(same(r.champion, r.challenger) for r in rows) / len(rows)
    base = {
        "champion_version": common["champion_version"],
        "scorer": common["scorer"],
        "requests": len(rows),
        "scored": len(scored),
        "spread": round(spread, 4),
        "threshold": round(threshold, 4),
        "agreement": round(agreement, 4),
    }
    test, figure = words["test"], words["figure"]
    if scores is None:
        return ShadowResult(**base, regressed=False, reason=f"shadow: {len(rows)} requests replayed, {words['none']}")
    (champ, chall), (wins, losses, p_worse, p_better) = scores, tests
    alpha = common["alpha"]
    regressed = chall - champ < -threshold and p_worse < alpha
    improved = chall - champ > threshold and p_better < alpha
    verdict = "regressed" if regressed else "better" if improved else "no significant difference"
    reason = (
        f"shadow: {verdict} on {len(scored)} replayed requests {words['by']}: challenger "
        f"{chall:{figure}} against champion {champ:{figure}} ({test} = {p_better if improved else p_worse:.3g}, "
        f"alpha {alpha:g}; threshold {threshold:{figure}}, spread {spread:{figure}})"
    )
    return ShadowResult(
        **base,
        champion=round(champ, 4),
        challenger=round(chall, 4),
        difference=round(chall - champ, 4),
        wins=wins,
        losses=losses,
        p_value=p_worse,
        p_better=p_better,
        regressed=regressed,
        improved=improved,
        reason=reason,
        worst=worst,
    )


def by_exact_match(rows: list[Replayed], second: list[str] | None, **common) -> ShadowResult:
    """The replay scored against users' references, McNemar's exact test on the discordant pairs."""
    for row in rows:
        if row.reference is not None:
            row.champion_ok, row.challenger_ok = same(row.champion, row.reference), same(row.challenger, row.reference)
    scored = [r for r in rows if r.reference is not None]
    wins = sum(1 for r in scored if r.challenger_ok and not r.champion_ok)
    losses = sum(1 for r in scored if r.champion_ok and not r.challenger_ok)
    spread = abs(success(rows, [r.challenger for r in rows]) - success(rows, second)) if second and scored else 0.0
    worst = [r for r in scored if r.champion_ok and not r.challenger_ok][:5]
    scores = None
    if scored:
        scores = tuple(
            sum(bool(getattr(r, side)) for r in scored) / len(scored) for side in ("champion_ok", "challenger_ok")
        )
    agreement = sum(same(r.champion, r.challenger) for r in rows) / len(rows)
    words = {
        "by": "with a reference",
        "none": f"none with a user's reference to score (agreement with the champion {agreement:.0%})",
        "test": f"{wins} won, {losses} lost, McNemar p",
        "figure": ".1%",
    }
    return settle(
        rows,
        scored,
        scores,
        (wins, losses, mcnemar_p(wins, losses), mcnemar_p(losses, wins)),
        spread,
        {**common, "scorer": "exact_match"},
        worst,
        words,
    )


def sign_flip_p(differences: list[float], seed: int = 0, draws: int = 4000) -> tuple[float, float]:
    """Paired sign-flip test of the mean difference: ``(p of a mean this low, p of a mean this high)`` were the
    differences symmetric about 0 (no model better); exact for up to 12 pairs, else ``draws`` seeded flips."""
    import itertools
    import random

    n = len(differences)
    if n == 0:
        return 1.0, 1.0
    observed = sum(differences) / n
    if n <= 12:
        means = [
            sum(s * d for s, d in zip(signs, differences, strict=True)) / n
            for signs in itertools.product((1, -1), repeat=n)
        ]
    else:
        rng = random.Random(seed)
        means = [sum(d if rng.random() < 0.5 else -d for d in differences) / n for _ in range(draws)]
    low = sum(1 for m in means if m <= observed + 1e-12) / len(means)
    high = sum(1 for m in means if m >= observed - 1e-12) / len(means)
    return low, high


def reward_values(rewards: dict, tokenizer_dir: str | None, messages: list[list[dict]], answers: list[str]) -> list:
    """Each answer's weighted reward (None where no reward applies), scored as training scores completions: the
    prompt as its message list, the answer as one assistant message, its token ids by the model's tokenizer."""
    import math

    from ladle.rewards import RewardSet, weighted_sum

    reward_set = RewardSet.model_validate(rewards)
    loaded = reward_set.loaded()
    ids: list[list[int]] = [[] for _ in answers]
    if tokenizer_dir:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        ids = [tokenizer(a, add_special_tokens=False)["input_ids"] for a in answers]
    import torch

    completions = [[{"role": "assistant", "content": a}] for a in answers]
    table = torch.full((len(answers), len(loaded)), float("nan"), dtype=torch.float32)
    for j, reward in enumerate(loaded):
        values = reward(messages, completions, ids, {}, None)
        table[:, j] = torch.tensor([float("nan") if v is None else v for v in values], dtype=torch.float32)
    return [None if math.isnan(v) else float(v) for v in weighted_sum(loaded, table).tolist()]


def by_reward(
    rows: list[Replayed],
    second: list[str] | None,
    messages: list[list[dict]],
    rewards: dict,
    tokenizer_dir: str | None,
    **common,
) -> ShadowResult:
    """The replay scored by the run's rewards (``eval.metric: reward``): every request, no reference needed; a
    paired sign-flip test of the challenger's reward minus the champion's."""
    champ = reward_values(rewards, tokenizer_dir, messages, [r.champion for r in rows])
    chall = reward_values(rewards, tokenizer_dir, messages, [r.challenger for r in rows])
    for row, a, b in zip(rows, champ, chall, strict=True):
        row.champion_reward, row.challenger_reward = a, b
    scored = [r for r in rows if r.champion_reward is not None and r.challenger_reward is not None]
    diffs = [r.challenger_reward - r.champion_reward for r in scored]
    spread = 0.0
    if second is not None and scored:
        again = reward_values(rewards, tokenizer_dir, messages, second)
        pairs = [
            (r.challenger_reward, g)
            for r, g in zip(rows, again, strict=True)
            if r.challenger_reward is not None and r.champion_reward is not None and g is not None
        ]
        if pairs:
            spread = abs(sum(a - b for a, b in pairs) / len(pairs))
    worst = sorted(
        (r for r in scored if r.challenger_reward < r.champion_reward),
        key=lambda r: r.challenger_reward - r.champion_reward,
    )[:5]
    scores = None
    if scored:
        scores = tuple(
            sum(getattr(r, side) for r in scored) / len(scored) for side in ("champion_reward", "challenger_reward")
        )
    tests = (sum(1 for d in diffs if d > 0), sum(1 for d in diffs if d < 0), *sign_flip_p(diffs))
    words = {"by": "scored by the rewards", "none": "none the rewards apply to", "test": "paired sign-flip p"}
    words["figure"] = ".4g"
    return settle(rows, scored, scores, tests, spread, {**common, "scorer": "reward"}, worst, words)
