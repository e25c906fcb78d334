"""Shadow evaluation (``promote.shadow``): the champion's captured requests, replayed to a challenger's real server
as they were sent, scored against what users corrected or approved, and gated by McNemar's paired test."""

from __future__ import annotations

import httpx
import pytest

from ladle.lifecycle import gate
from ladle.lifecycle.shadow import ShadowPlan, mcnemar_p
from ladle.serve.capture import CaptureSettings, Recorder

PROMPTS = [f"{a} {b}" for a in ("red", "blue", "green", "black") for b in ("white", "yellow")]


def answers(server, prompts, **sampling) -> list[str]:
    out = []
    for prompt in prompts:
        body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 4, **sampling}
        reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        out.append(reply.json()["choices"][0]["message"]["content"])
    return out


def champion_traffic(store, cases, version: str = "1", temperature: float = 0.0, max_tokens: int = 4) -> None:
    """What the champion answered and what its users said: ``cases`` of (prompt, logged answer, feedback)."""
    rec = Recorder(CaptureSettings(enabled=True, flush_s=0.05), str(store), "tiny-cpu", version)
    for i, (prompt, answer, _) in enumerate(cases):
        request = {
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": temperature,
        }
        if temperature:
            request["seed"] = 11
        record = {"at": f"2026-12-07T10:00:{i:02d}", "route": "chat", "request": request, "answer": {"content": answer}}
        assert rec.record(f"chatcmpl-{version}-{i}", record)
    for i, (_, _, said) in enumerate(cases):
        if said is not None:
            rec.feedback({"response_id": f"chatcmpl-{version}-{i}", "name": "user_feedback", **said})
    rec.close()


def plan(store, requests: int = 100, version: str | None = "1") -> ShadowPlan:
    return ShadowPlan(
        traffic_url=str(store),
        champion_name="tiny-cpu",
        champion_version=version,
        requests=requests,
        max_regression=0.0,
        alpha=0.05,
        good_score=0.5,
    )


def test_mcnemar_is_the_exact_one_sided_binomial_of_the_discordant_pairs():
    assert mcnemar_p(0, 0) == 1.0 and mcnemar_p(5, 0) == 1.0
    assert mcnemar_p(0, 3) == pytest.approx(1 / 8)
    assert mcnemar_p(1, 5) == pytest.approx(7 / 64)  # P(X >= 5), X ~ Binomial(6, 1/2)
    assert mcnemar_p(0, 8) == pytest.approx(1 / 256)


def test_a_challenger_that_loses_what_users_approved_is_held_back_and_one_that_fixes_corrections_is_not(
    server, tmp_path
):
    challenger = answers(server, PROMPTS, temperature=0)

    # The champion's answers, approved by its users; the challenger answers otherwise: 8 losses of 8.
    approved = tmp_path / "approved"
    champion_traffic(approved, [(p, f"right-{i}", {"value": True}) for i, p in enumerate(PROMPTS)])
    lost = plan(approved).check(server.url, "tiny", {})
    assert lost["requests"] == 8 and lost["scored"] == 8 and lost["losses"] == 8 and lost["wins"] == 0
    assert lost["p_value"] == pytest.approx(1 / 256) and lost["regressed"] is True
    assert lost["champion"] == 1.0 and lost["challenger"] == 0.0 and lost["spread"] == 0.0  # greedy: no spread
    assert [(w["champion"], w["challenger"]) for w in lost["worst"]] == [
        (f"right-{i}", challenger[i]) for i in range(5)
    ]
    assert "shadow: regressed on 8 replayed requests" in lost["reason"]

    # The champion was wrong and its users corrected it to what the challenger answers: 8 wins.
    corrected = tmp_path / "corrected"
    cases = [(p, "wrong", {"value": False, "correction": challenger[i]}) for i, p in enumerate(PROMPTS)]
    champion_traffic(corrected, cases)
    won = plan(corrected).check(server.url, "tiny", {})
    assert (won["wins"], won["losses"], won["regressed"], won["improved"]) == (8, 0, False, True)
    assert won["p_better"] == pytest.approx(1 / 256) and won["champion_version"] == "1"
    assert "shadow: better on 8 replayed requests" in won["reason"]

    # Three requests lost of four scored is not significant (p = 5/16): no regression is claimed from noise.
    few = tmp_path / "few"
    cases = [(p, f"right-{i}", {"value": True}) for i, p in enumerate(PROMPTS[:3])]
    cases += [(PROMPTS[3], "wrong", {"value": 0.0, "correction": challenger[3]})]
    cases += [(p, challenger[4 + i], None) for i, p in enumerate(PROMPTS[4:])]  # unjudged: agreement only
    champion_traffic(few, cases)
    noisy = plan(few).check(server.url, "tiny", {})
    assert (noisy["scored"], noisy["wins"], noisy["losses"]) == (4, 1, 3)
    assert noisy["p_value"] == pytest.approx(5 / 16) and noisy["regressed"] is False and noisy["improved"] is False
    assert noisy["agreement"] == 0.5  # the four unjudged answers equal the challenger's

    # A request the challenger's server refuses (here: more tokens than it allows) is an answer it did not give.
    refused = tmp_path / "refused"
    champion_traffic(refused, [(PROMPTS[0], "right", {"value": True})], max_tokens=10**6)
    lost = plan(refused).check(server.url, "tiny", {})
    assert lost["worst"][0]["challenger"].startswith("[refused: HTTP 400")


def test_sampled_requests_are_replayed_twice_and_only_the_champions_version_is_used(server, tmp_path):
    store = tmp_path / "traffic"
    champion_traffic(store, [(p, "older", {"value": True}) for p in PROMPTS[:2]], version="1")
    champion_traffic(store, [(p, f"right-{i}", {"value": True}) for i, p in enumerate(PROMPTS)], "2", temperature=1.0)
    result = plan(store, requests=6, version="2").check(server.url, "tiny", {})
    assert result["requests"] == 6  # the newest six of version 2's, not version 1's
    assert 0.0 <= result["spread"] <= 1.0 and result["threshold"] == result["spread"]
    assert plan(tmp_path / "nothing").check(server.url, "tiny", {}) is None


def test_the_gate_holds_back_a_promotion_the_replay_says_regressed_and_promotes_one_it_says_won():
    passed = gate.Decision(
        promoted=True,
        metric="exact_match",
        greater_is_better=True,
        candidate=0.9,
        reference=0.8,
        against="champion v1",
        min_improvement=0.0,
        improvement=0.1,
        reason="promoted: exact_match 0.9 > 0.8",
    )
    held = gate.guard_shadow(passed, "shadow: regressed on 8 replayed requests")
    assert held.promoted is False and held.reason.startswith("not promoted: shadow: regressed")
    assert gate.guard_shadow(passed, None) is passed

    tied = passed.model_copy(
        update={"promoted": False, "candidate": 0.8, "improvement": 0.0, "reason": "not promoted: exact_match 0.8"}
    )
    won = gate.win_on_traffic(tied, ("champion v1", "shadow: better on 8 replayed requests"))
    assert won.promoted is True and won.reason == "promoted: shadow: better on 8 replayed requests; the task gate: " + (
        "exact_match 0.8"
    )
    assert gate.win_on_traffic(tied, ("champion v2", "shadow: better")) is tied  # another champion was replayed
    worse = tied.model_copy(update={"improvement": -0.01})
    assert gate.win_on_traffic(worse, ("champion v1", "shadow: better")) is worse  # the task may not get worse


def test_a_grpo_run_scores_the_replay_by_its_rewards_with_a_paired_sign_flip_test(server, tiny_model, tmp_path):
    """``eval.metric: reward``: every replayed request is scored by the run's rewards (no user reference needed),
    the champion's logged answer against the challenger's, and the paired sign-flip test decides."""
    import re

    from ladle.config.training import RewardConfig
    from ladle.lifecycle.shadow import sign_flip_p
    from ladle.rewards import RewardSet

    assert sign_flip_p([-1.0] * 8) == (pytest.approx(1 / 256), 1.0)
    assert sign_flip_p([1.0, -1.0]) == (0.75, 0.75)
    challenger = answers(server, PROMPTS, temperature=0)
    store = tmp_path / "traffic"
    champion_traffic(store, [(p, f"right-{i}", None) for i, p in enumerate(PROMPTS)])  # nobody judged them

    def scored_by(pattern: str) -> dict:
        rewards = RewardSet(rewards=[RewardConfig(fn="regex", args={"pattern": pattern})])
        replay = plan(store).model_copy(
            update={"scorer": "reward", "rewards": rewards.model_dump(), "tokenizer_dir": str(tiny_model)}
        )
        return replay.check(server.url, "tiny", {})

    lost = scored_by("^right")  # the champion's answers score 1, the challenger's 0
    assert (lost["scorer"], lost["scored"], lost["losses"], lost["regressed"]) == ("reward", 8, 8, True)
    assert lost["p_value"] == pytest.approx(1 / 256) and lost["champion"] == 1.0 and lost["challenger"] == 0.0
    assert lost["worst"][0]["champion_reward"] == 1.0 and lost["worst"][0]["challenger_reward"] == 0.0
    won = scored_by("(?:" + "|".join(re.escape(a) for a in challenger) + r")\Z")
    assert (won["wins"], won["improved"], won["regressed"]) == (8, True, False)
    assert "paired sign-flip p" in won["reason"]


def test_a_replay_the_rewards_cannot_score_is_refused_before_training_and_other_scorers_at_validation():
    from types import SimpleNamespace

    from ladle.config import build_config
    from ladle.errors import ConfigError, LadleError
    from ladle.tasks.deploy import shadow_plan

    grpo = {
        "base": "ladle://tiny-llama",
        "data": {"path": "ladle://demo-prompts", "format": "prompt"},
        "training": {"objective": "grpo", "rl": {"rewards": [{"fn": "exact_match", "args": {"column": "answer"}}]}},
        "eval": {"metric": "reward"},
        "promote": {"shadow": {"requests": 50}},
    }
    cfg = build_config(grpo, [])
    inputs = SimpleNamespace(reward_columns=["answer"], reward_files={}, base_dir="/nowhere")
    with pytest.raises(LadleError, match="the rewards read answer, which captured traffic does not carry"):
        shadow_plan(cfg, inputs)
    with pytest.raises(ConfigError, match="promote.shadow.requests = 50 with eval.metric = 'loss'"):
        build_config({**grpo, "eval": {"metric": "loss"}}, [])
