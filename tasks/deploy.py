"""Prefect task: start the inference server, check it answers and that it computes what training did."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_link_artifact

from ladle.config import PromoteConfig, ServeConfig
from ladle.data.prepare import PreparedDataset
from ladle.fleet.deploy import Endpoint, deploy
from ladle.lifecycle import parity
from ladle.lifecycle.evaluate import load_samples
from ladle.lifecycle.merge import MergedModel
from ladle.lifecycle.shadow import ShadowPlan
from ladle.serve import backends
from ladle.tasks.policy import retry_unless_user_error
from ladle.train.spec import TrainResult


def parity_check(
    merged: MergedModel,
    result: TrainResult,
    promote: PromoteConfig,
    base_dir: str,
    unmerged: bool,
):
    """``(url, model, headers) -> Parity`` against the training process's log-probabilities of the probe, or the
    saved weights' when the strategy split its forward (see ``ladle.lifecycle.parity``); and for an agent, the
    served tool calls of its held-out first turns against the rollouts'. None without probe rows."""
    rows = [parity.ProbeRow.model_validate(row) for row in result.parity_probe]
    if not rows:
        return None
    by_logps = logps_check(merged, result, promote, base_dir, unmerged, rows)
    cases = [parity.ToolCase.model_validate(case) for case in result.tool_parity]
    if not cases:
        return by_logps

    def measure(url: str, model: str, headers: dict) -> parity.Parity:
        found = by_logps(url, model, headers)
        differs = parity.check_tool_calls(url, model, cases, headers)
        if differs is None:
            where = found.where if found.ok is not True else None
            extra = f"; tool calls: {len(cases)} held-out first turns called the same"
            return found.model_copy(update={"reference": found.reference + extra, "where": where})
        return found.model_copy(update={"ok": False, "where": differs})

    return measure


def logps_check(merged, result, promote, base_dir: str, unmerged: bool, rows):
    """The log-probability half of ``parity_check``."""
    # The coarser of the served weights' dtype and the dtype the training forward computed in.
    compared = result.weights_dtype if result.weights_dtype != "float32" else (result.parity_dtype or "float32")
    tolerance = promote.parity_tolerance or parity.TOLERANCE[compared]

    def measure(url: str, model: str, headers: dict) -> parity.Parity:
        from transformers import AutoTokenizer

        from ladle.fleet.deploy import local_model_dir

        if result.parity_logps is not None:
            reference, how = result.parity_logps, "training process"
        else:  # the strategy split one forward over ranks: the weights it saved, loaded as transformers does
            how = f"saved weights ({result.strategy} splits the training forward over ranks)"
            if unmerged:
                adapter = MergedModel(url=merged.adapter_url, sha256=merged.adapter_sha256, parameters=0)
                reference = parity.saved_logps(base_dir, rows, local_model_dir(adapter))
            else:
                reference = parity.saved_logps(local_model_dir(merged), rows)
        tokenizer = AutoTokenizer.from_pretrained(base_dir)
        return parity.check(url, model, rows, reference, how, tolerance, tokenizer, headers)

    return measure


@task(name="deploy-server", retries=1, retry_delay_seconds=2, retry_condition_fn=retry_unless_user_error)
def deploy_task(
    serving: ServeConfig,
    name: str,
    merged: MergedModel,
    prepared: PreparedDataset,
    result: TrainResult | None = None,
    promote: PromoteConfig | None = None,
    base_dir: str | None = None,
    shadow: ShadowPlan | None = None,
) -> Endpoint:
    unmerged = promote is not None and not promote.merge and merged.adapter_url is not None
    check = None
    if result is not None and promote is not None and base_dir is not None:
        check = parity_check(merged, result, promote, base_dir, unmerged)
        if check is not None and not backends.get(serving.backend).supports_logprobs:
            why = f"not measured: the {serving.backend} backend returns no log-probabilities"

            def check(url, model, headers):
                return parity.Parity(ok=None, reference="-", where=why)

    endpoint = deploy(
        merged,
        serving,
        name,
        held_out=load_samples(prepared, 1),
        base_dir=Path(base_dir) if unmerged else None,
        parity_of=check,
        shadow_of=shadow.check if shadow is not None else None,
    )
    logger = get_run_logger()
    verdict = (
        ""
        if endpoint.expected is None
        else f" (expected {endpoint.expected!r}: {'correct' if endpoint.answer_correct else 'wrong'})"
    )
    logger.info("smoke request %r answered %r%s", endpoint.prompt, endpoint.answer, verdict)
    if endpoint.parity is not None:
        p = endpoint.parity
        if p.ok:
            logger.info(
                "parity: the server computes what training did (%d answer tokens of %d held-out conversations, "
                "max |difference| %.3g <= %g, reference: %s)",
                p.answer_tokens,
                p.rows,
                p.max_abs,
                p.tolerance,
                p.reference,
            )
        else:
            logger.warning("parity: the served model is not the trained one: %s", p.where)
    if shadow is not None:
        said = (
            endpoint.shadow["reason"]
            if endpoint.shadow
            else (f"shadow: {shadow.champion_name} has no captured request under {shadow.traffic_url} to replay")
        )
        (logger.warning if endpoint.shadow and endpoint.shadow["regressed"] else logger.info)(said)
    if endpoint.running:
        create_link_artifact(
            key="endpoint", link=endpoint.url, description=f"{endpoint.backend} server, pid {endpoint.pid}"
        )
        logger.info("server running at %s (pid %s)", endpoint.url, endpoint.pid)
    else:
        logger.info("server stopped after the smoke request (serve.keep_running=false)")
    return endpoint


def shadow_plan(cfg, inputs) -> ShadowPlan | None:
    """``promote.shadow`` resolved: the champion whose traffic is replayed and how it is scored (None: off, or no
    champion yet).

    Raises:
        LadleError: the replay is scored by rewards that read data columns, which captured traffic does not carry
            (checked before training, by the flow).
    """
    if not cfg.promote.shadow.requests:
        return None
    from ladle.errors import LadleError
    from ladle.lifecycle import promote
    from ladle.platform import storage
    from ladle.rewards import RewardSet

    scorer = "reward" if cfg.eval.metric == "reward" else "exact_match"
    rewards = RewardSet.of_run(cfg.training, inputs.reward_files) if scorer == "reward" else None
    extra = [c for c in inputs.reward_columns or [] if c != "prompt"]
    if scorer == "reward" and (extra or inputs.reward_columns is None):
        read = ", ".join(extra) or "every column (**kwargs)"
        raise LadleError(
            f"promote.shadow.requests = {cfg.promote.shadow.requests} with eval.metric = reward: the rewards read "
            f"{read}, which captured traffic does not carry; score the replay by rewards of the prompt and the "
            "answer only, or set promote.shadow.requests=0"
        )
    current = promote.champion(inputs.tracking_uri, inputs.registered_model)
    if current is None:
        return None
    url = cfg.retrain.traffic_url or cfg.serve.capture.url or storage.join(cfg.output, "traffic")
    return ShadowPlan(
        traffic_url=storage.normalise(url),
        champion_name=inputs.registered_model,
        champion_version=str(current.version),
        requests=cfg.promote.shadow.requests,
        max_regression=cfg.promote.shadow.max_regression,
        alpha=cfg.promote.shadow.alpha,
        good_score=cfg.retrain.good_score,
        scorer=scorer,
        rewards=rewards.model_dump() if rewards else None,
        tokenizer_dir=str(inputs.base_dir),
    )
