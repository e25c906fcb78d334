"""What a training job on Kubernetes is doing, read from the objects ``kubectl get -o json`` returns.

Pure functions over the API's JSON, so the follow loop's decisions are tested against recorded objects
(``tests/kubernetes/k8s_recorded``): a Kubeflow Trainer ``TrainJob`` (its conditions are Trainer's ``Suspended``
and the ``Complete``/``Failed`` it copies from its JobSet), a Kubeflow ``PyTorchJob`` (the training
operator's ``Created``/``Running``/``Restarting``/``Succeeded``/``Failed``), the job's pods (the scheduler's
``PodScheduled`` condition, a container's waiting reason) and Kueue's ``Workload`` for the job (its
``QuotaReserved`` and ``Evicted`` conditions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Phase = Literal["pending", "running", "suspended", "succeeded", "failed"]

TRAINJOB_POD_LABEL = "jobset.sigs.k8s.io/jobset-name"  # JobSet labels every pod with its JobSet (= TrainJob) name
REPLICATED_JOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"
COMPLETION_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"  # the pod's index in its indexed Job
PYTORCHJOB_POD_LABEL = "training.kubeflow.org/job-name"
REPLICA_TYPE_LABEL = "training.kubeflow.org/replica-type"
KUEUE_JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"  # Kueue labels a job's Workload with the job's UID


@dataclass(frozen=True)
class JobState:
    """One look at a job: its phase, and the controller's reason and message for it."""

    phase: Phase
    reason: str = ""
    message: str = ""

    def why(self) -> str:
        return ": ".join(p for p in (self.reason, self.message) if p)


def _conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c.get("type", ""): c for c in (obj.get("status") or {}).get("conditions") or []}


def _true(condition: dict[str, Any] | None) -> bool:
    return bool(condition) and condition.get("status") == "True"


def _state(phase: Phase, condition: dict[str, Any] | None = None) -> JobState:
    condition = condition or {}
    return JobState(phase, condition.get("reason", ""), condition.get("message", ""))


def trainjob_state(obj: dict[str, Any]) -> JobState:
    """A TrainJob's phase. Terminal conditions win; ``Suspended=True`` means Kueue has not admitted it (or took
    its admission back); otherwise it runs once a child Job has a ready, finished or failed pod, else it
    is pending (created, pods not yet scheduled or pulling their image)."""
    conditions = _conditions(obj)
    if _true(conditions.get("Failed")):
        return _state("failed", conditions["Failed"])
    if _true(conditions.get("Complete")):
        return _state("succeeded", conditions["Complete"])
    if _true(conditions.get("Suspended")):
        return _state("suspended", conditions["Suspended"])
    jobs = (obj.get("status") or {}).get("jobsStatus") or []
    if any((j.get("ready") or 0) + (j.get("succeeded") or 0) + (j.get("failed") or 0) > 0 for j in jobs):
        return JobState("running")
    return _state("pending", conditions.get("Suspended"))


def pytorchjob_state(obj: dict[str, Any]) -> JobState:
    """A PyTorchJob's phase from the training operator's conditions (the newest true one decides)."""
    conditions = _conditions(obj)
    for kind, phase in (("Failed", "failed"), ("Succeeded", "succeeded"), ("Suspended", "suspended")):
        if _true(conditions.get(kind)):
            return _state(phase, conditions[kind])  # type: ignore[arg-type]
    if _true(conditions.get("Running")) or _true(conditions.get("Restarting")):
        return _state("running", conditions.get("Running") or conditions.get("Restarting"))
    return _state("pending", conditions.get("Created"))


def lead_pod(pods: dict[str, Any], api: str) -> dict[str, Any] | None:
    """Node rank 0's pod: the TrainJob's ``node`` Job, completion index 0; the PyTorchJob's master."""
    for pod in pods.get("items") or []:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        if api == "trainjob":
            if labels.get(REPLICATED_JOB_LABEL) == "node" and labels.get(COMPLETION_INDEX_LABEL, "0") == "0":
                return pod
        elif labels.get(REPLICA_TYPE_LABEL, "master") == "master":
            return pod
    return None


def pod_started(pod: dict[str, Any] | None) -> bool:
    return bool(pod) and (pod.get("status") or {}).get("phase") in ("Running", "Succeeded", "Failed")


def pods_waiting(pods: dict[str, Any]) -> list[str]:
    """What the pods wait for: the scheduler's message (``PodScheduled=False``), a container's waiting reason
    (``ImagePullBackOff``, ``CreateContainerConfigError`` for a missing secret)."""
    reasons = []
    for pod in pods.get("items") or []:
        status, name = pod.get("status") or {}, (pod.get("metadata") or {}).get("name", "?")
        for condition in status.get("conditions") or []:
            if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
                reasons.append(f"{name}: {condition.get('reason')}: {condition.get('message', '')}".strip(" :"))
        for container in status.get("containerStatuses") or []:
            waiting = (container.get("state") or {}).get("waiting")
            if waiting and waiting.get("reason") not in (None, "ContainerCreating", "PodInitializing"):
                reasons.append(f"{name}: {waiting.get('reason')}: {waiting.get('message', '')}".strip(" :"))
    return reasons


@dataclass(frozen=True)
class KueueVerdict:
    """What Kueue says about the job's Workload."""

    kind: Literal["admitted", "pending", "inadmissible", "evicted"]
    reason: str
    message: str

    def why(self) -> str:
        return f"Kueue: {self.reason}: {self.message}" if self.message else f"Kueue: {self.reason}"


def kueue_verdict(workloads: dict[str, Any]) -> KueueVerdict | None:
    """Kueue's word on the job, from its Workload's conditions: evicted (preempted, or its pods not ready in
    time) while not admitted again, inadmissible (a queue that does not exist or is stopped), pending
    (no quota yet), or admitted. None when Kueue has no Workload for it (no Kueue, or not yet)."""
    items = workloads.get("items") or []
    if not items:
        return None
    conditions = _conditions(items[0])
    reserved, evicted = conditions.get("QuotaReserved"), conditions.get("Evicted")
    if _true(conditions.get("Admitted")):
        return KueueVerdict("admitted", "Admitted", conditions["Admitted"].get("message", ""))
    if _true(evicted):
        return KueueVerdict("evicted", evicted.get("reason", "Evicted"), evicted.get("message", ""))
    if reserved and reserved.get("status") == "False":
        kind = "inadmissible" if reserved.get("reason") == "Inadmissible" else "pending"
        return KueueVerdict(kind, reserved.get("reason", ""), reserved.get("message", ""))
    return KueueVerdict("pending", "NotAttempted", "no admission attempt yet (StrictFIFO queues try only their head)")


def pods_failed(pods: dict[str, Any]) -> list[str]:
    """Why the job's pods ended badly: the kubelet's eviction (``status.reason``), a container's termination
    (``OOMKilled``, ``Error`` with its exit code)."""
    reasons = []
    for pod in pods.get("items") or []:
        status, name = pod.get("status") or {}, (pod.get("metadata") or {}).get("name", "?")
        if status.get("reason"):
            reasons.append(f"{name}: {status['reason']}: {status.get('message', '')}".strip(" :"))
        for container in status.get("containerStatuses") or []:
            ended = (container.get("state") or {}).get("terminated") or {}
            if ended and ended.get("exitCode", 0) != 0:
                reasons.append(f"{name}: {ended.get('reason', 'Error')} (exit code {ended.get('exitCode')})")
    return reasons
