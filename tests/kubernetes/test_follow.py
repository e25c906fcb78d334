"""Following a training job on Kubernetes, against recorded objects (``k8s_recorded/``, sources in its
SOURCES.md): the train stage submits the TrainJob (and its ClusterTrainingRuntime when the cluster lacks it),
streams rank 0's log, returns on completion, and ends every other way with the cluster's own reason and what to
change, deleting the job. The stand-in kubectl plays the recorded sequence back; no cluster is reachable here."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from ladle.compute.kubernetes import KubernetesTarget
from ladle.config import build_config
from ladle.errors import LadleError
from ladle.kubernetes import status as k8s_status
from ladle.train.run import TrainingFailed
from tests.helpers import train_spec
from tests.kubernetes import fake_kubectl

RECORDED = Path(__file__).parent / "k8s_recorded"


def scenario(name: str) -> dict:
    return json.loads((RECORDED / f"{name}.json").read_text())


def follow(tmp_path, monkeypatch, name: str, timeout_s: float = 30.0, api: str = "trainjob", **changes):
    """Run the kubernetes target's train stage against scenario ``name``; returns (outcome, calls, lines, took).
    A scenario that moves on is given 30 s to start running, so that a busy machine's slow stand-in kubectl
    (a Python process per call) never trips the deadline; one that tests the deadline passes 1 s."""
    played = {**scenario(name), **changes}
    home = fake_kubectl.install(tmp_path, played)
    monkeypatch.setenv("FAKE_KUBECTL", str(home))
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setattr(KubernetesTarget, "POLL_S", 0.05)
    monkeypatch.setattr("ladle.train.run.write_spec", lambda spec, tmp: None)  # the run folder is on S3
    monkeypatch.setattr("ladle.train.run.read_result", lambda spec: "train_result.json")
    kubernetes = {"api": api, "schedule_timeout_s": timeout_s, "queue": played.get("queue")}
    cfg = build_config(
        {
            "base": "ladle://tiny-llama",
            "data": {"path": "ladle://demo-alpaca", "seq_len": 128},
            "output": "s3://models/ladle",
            "parallelism": {"nodes": 2, "cpu_processes": 2},
            "compute": {"target": "kubernetes", "kubernetes": kubernetes},
        },
        [],
    )
    spec = train_spec(cfg, tmp_path, "k8s")
    lines: list[str] = []
    began = time.monotonic()
    try:
        outcome = KubernetesTarget(cfg).run(spec, on_line=lines.append)
    except (LadleError, TrainingFailed) as e:
        outcome = e
    took = time.monotonic() - began
    calls = [json.loads(line) for line in (home / "calls.jsonl").read_text().splitlines()]
    return outcome, calls, lines, took


def verbs(calls) -> list[str]:
    return [" ".join(c["argv"][:2]) for c in calls]


def test_a_trainjob_that_completes_creates_its_runtime_streams_rank_0_and_returns(tmp_path, monkeypatch):
    outcome, calls, lines, _ = follow(tmp_path, monkeypatch, "trainjob_complete")
    assert outcome == "train_result.json"
    applied = [c["stdin"]["kind"] for c in calls if c["argv"][0] == "apply"]
    assert applied == ["ClusterTrainingRuntime", "TrainJob"]  # the runtime first: the job references it
    job = next(c["stdin"] for c in calls if c["argv"][0] == "apply" and c["stdin"]["kind"] == "TrainJob")
    runtime = next(c["stdin"] for c in calls if c["argv"][0] == "apply" and c["stdin"]["kind"] != "TrainJob")
    assert job["spec"]["runtimeRef"]["name"] == runtime["metadata"]["name"]
    assert [c["argv"][:3] for c in calls if c["argv"][0] == "logs"] == [["logs", "-f", "ladle-k8s-node-0-0-a1b2c"]]
    assert "training on ladle-k8s-node-0-0-a1b2c" in lines
    # a retry's leftover is deleted before the apply; nothing is deleted after a success
    deletes = [i for i, v in enumerate(verbs(calls)) if v == "delete trainjobs.trainer.kubeflow.org"]
    job_apply = next(i for i, c in enumerate(calls) if c["argv"][0] == "apply" and c["stdin"]["kind"] == "TrainJob")
    assert deletes == [job_apply - 1]


def test_a_log_stream_that_hangs_after_the_job_ended_is_stopped(tmp_path, monkeypatch):
    monkeypatch.setattr("ladle.compute.kubernetes.LOG_DRAIN_S", 0.5)
    steps = scenario("trainjob_complete")["steps"]
    ended = [steps[0], steps[-1]]  # its pod has succeeded by the time its log is followed
    outcome, calls, lines, took = follow(tmp_path, monkeypatch, "trainjob_complete", log_hangs=True, steps=ended)
    assert outcome == "train_result.json", outcome
    assert "training on ladle-k8s-node-0-0-a1b2c" in lines
    assert any("did not end 0.5 s after the job did; stopped" in line for line in lines)
    assert took < 300  # not the stream's 600 s


def test_an_existing_runtime_is_not_applied_again(tmp_path, monkeypatch):
    outcome, calls, _, _ = follow(tmp_path, monkeypatch, "trainjob_complete", runtime_exists=True)
    assert outcome == "train_result.json"
    assert [c["stdin"]["kind"] for c in calls if c["argv"][0] == "apply"] == ["TrainJob"]


def test_a_runtime_the_service_account_may_not_create_is_named_with_the_fix(tmp_path, monkeypatch):
    forbidden = (
        "Error from server (Forbidden): clustertrainingruntimes.trainer.kubeflow.org is forbidden: User "
        '"system:serviceaccount:default:ladle" cannot create resource "clustertrainingruntimes"'
    )
    outcome, calls, _, _ = follow(
        tmp_path, monkeypatch, "trainjob_complete", refuse={"ClusterTrainingRuntime": forbidden}
    )
    assert isinstance(outcome, LadleError)
    assert "the cluster has no ClusterTrainingRuntime ladle-torch-" in str(outcome)
    assert "cannot create resource" in str(outcome) and "kubectl apply -f -" in str(outcome)
    assert "apply -f" in verbs(calls) and not any(v.startswith("get trainjobs") for v in verbs(calls))


def test_a_failed_trainjob_names_the_jobsets_reason_and_the_oom_killed_pod(tmp_path, monkeypatch):
    outcome, calls, _, _ = follow(tmp_path, monkeypatch, "trainjob_failed_oom")
    assert isinstance(outcome, TrainingFailed)
    assert str(outcome).startswith(
        "TrainJob default/ladle-k8s ended Failed (FailedJobs: jobset failed due to one or more job failures; "
        "ladle-k8s-node-0-0-a1b2c: OOMKilled (exit code 137))"
    )


def test_unschedulable_pods_end_at_the_deadline_with_the_schedulers_message(tmp_path, monkeypatch):
    outcome, calls, _, took = follow(tmp_path, monkeypatch, "trainjob_unschedulable", timeout_s=1)
    assert isinstance(outcome, LadleError) and took < 120  # ends at the deadline, not never
    assert str(outcome).startswith(
        "compute.kubernetes.schedule_timeout_s = 1: TrainJob default/ladle-k8s did not start running in 1 s "
        "(ladle-k8s-node-0-0-a1b2c: Unschedulable: 0/9 nodes are available: 9 node(s) didn't match Pod's node "
        "affinity/selector."
    )
    assert "compute.kubernetes.gpus_per_node" in str(outcome)
    assert verbs(calls)[-1] == "delete trainjobs.trainer.kubeflow.org"


def test_a_job_kueue_never_admits_ends_with_kueues_reason(tmp_path, monkeypatch):
    outcome, calls, _, _ = follow(tmp_path, monkeypatch, "trainjob_kueue_pending", timeout_s=1)
    assert isinstance(outcome, LadleError)
    assert "TrainJob default/ladle-k8s was not admitted in 1 s (Kueue: Pending: couldn't assign flavors to pod " in (
        str(outcome)
    )
    applied = next(c["stdin"] for c in calls if c["argv"][0] == "apply" and c["stdin"]["kind"] == "TrainJob")
    assert applied["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "user-queue"
    looked_up = [c["argv"] for c in calls if c["argv"][:2] == ["get", "workloads.kueue.x-k8s.io"]]
    assert looked_up and "kueue.x-k8s.io/job-uid=5e7c1d0a-trainjob" in looked_up[0]
    assert verbs(calls)[-1] == "delete trainjobs.trainer.kubeflow.org"


def test_a_queue_that_cannot_admit_ends_at_once_not_at_the_deadline(tmp_path, monkeypatch):
    outcome, calls, _, took = follow(tmp_path, monkeypatch, "trainjob_kueue_inadmissible", timeout_s=600)
    assert isinstance(outcome, LadleError) and took < 300  # at once, not at the 600 s deadline
    assert str(outcome).startswith(
        "compute.kubernetes.queue = 'user-queue': TrainJob default/ladle-k8s cannot be admitted (Kueue: "
        "Inadmissible: LocalQueue user-queue doesn't exist)"
    )
    assert verbs(calls)[-1] == "delete trainjobs.trainer.kubeflow.org"


def test_a_preempted_job_waits_for_readmission_then_names_the_preemption(tmp_path, monkeypatch):
    # 8 s: the wait before Kueue first admits it (step 0) must not run out before the preemption, however busy
    # this machine is; the wait after the preemption then runs its full 8 s.
    outcome, calls, lines, _ = follow(tmp_path, monkeypatch, "trainjob_preempted", timeout_s=8)
    assert isinstance(outcome, LadleError)
    assert "TrainJob default/ladle-k8s was preempted (Kueue: Preempted: Preempted to accommodate a higher " in str(
        outcome
    )
    assert "WorkloadPriorityClass" in str(outcome) and "resumes from the last checkpoint" in str(outcome)
    assert any("stopped running (Kueue: Preempted" in line for line in lines)
    assert verbs(calls)[-1] == "delete trainjobs.trainer.kubeflow.org"


def test_a_preempted_job_admitted_again_streams_its_new_pod_and_completes(tmp_path, monkeypatch):
    outcome, calls, lines, _ = follow(tmp_path, monkeypatch, "trainjob_preempted_then_complete")
    assert outcome == "train_result.json"
    streamed = [c["argv"][2] for c in calls if c["argv"][0] == "logs"]
    assert streamed == ["ladle-k8s-node-0-0-a1b2c", "ladle-k8s-node-0-0-d4e5f"]
    assert any("stopped running (Kueue: Preempted" in line for line in lines)
    assert verbs(calls).count("delete trainjobs.trainer.kubeflow.org") == 1  # only the retry's, before the apply


def test_a_cancel_while_following_deletes_the_job(tmp_path, monkeypatch):
    """A Prefect cancel or Ctrl-C arrives as an exception in the follow loop: the job is deleted on its way out."""
    calls_seen = []

    def interrupted(self, *args, **kwargs):
        calls_seen.append(args)
        raise KeyboardInterrupt

    monkeypatch.setattr(KubernetesTarget, "follow", interrupted)
    with pytest.raises(KeyboardInterrupt):
        follow(tmp_path, monkeypatch, "trainjob_complete")
    calls = [json.loads(x) for x in (tmp_path / "kubectl-home" / "calls.jsonl").read_text().splitlines()]
    assert calls_seen and verbs(calls)[-1] == "delete trainjobs.trainer.kubeflow.org"


@pytest.mark.parametrize(
    ("name", "phases"),
    [
        ("trainjob_complete", ["pending", "pending", "succeeded"]),
        ("trainjob_failed_oom", ["pending", "failed"]),
        ("trainjob_preempted", ["suspended", "pending", "suspended"]),
    ],
)
def test_each_recorded_status_reads_as_its_phase(name, phases):
    """The phase of each recorded TrainJob status (a resumed TrainJob whose pod is not ready is pending: the
    pod's phase, not the TrainJob's, says when it runs)."""
    assert [k8s_status.trainjob_state({"status": s["status"]}).phase for s in scenario(name)["steps"]] == phases


def test_kueues_recorded_workloads_read_as_their_verdicts():
    kinds = []
    for name in ("trainjob_kueue_pending", "trainjob_kueue_inadmissible", "trainjob_preempted"):
        for step in scenario(name)["steps"]:
            kinds.append(k8s_status.kueue_verdict({"items": step["workloads"]}).kind)
    assert kinds == ["pending", "inadmissible", "pending", "admitted", "evicted"]
    assert k8s_status.kueue_verdict({"items": []}) is None
