"""``compute.target: kubernetes``: multi-node training as a Kubeflow Trainer v2 ``TrainJob``
(``trainer.kubeflow.org/v1alpha1``, the default) or a Kubeflow ``PyTorchJob`` (``kubeflow.org/v1``,
``compute.kubernetes.api: pytorchjob``, for clusters still on the training operator 1.9).

Either way one pod per node runs ``ladle launch`` with the rank and rendezvous the controller puts in its
environment (Trainer: ``PET_NODE_RANK``, ``PET_MASTER_ADDR``, ``PET_MASTER_PORT``; the operator: ``PET_NODE_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``), which starts the plan's launch for that node: the same launch as
every other target. A ``TrainJob`` references a ``ClusterTrainingRuntime``; ladle renders the one that carries
its pods' settings (``/dev/shm``, the env secret, tolerations, node selector), named by their hash, and creates it
when the cluster lacks it. ``compute.kubernetes.queue`` adds Kueue's queue label.

``render``/``render_trainjob`` are pure (tested against the CRDs' and Kubernetes' published schemas); ``run``
submits with ``kubectl``, follows the job (``k8s_status`` reads its state, its pods' and Kueue's) and deletes it on
any way out but success or failure of the training itself.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import subprocess
import tempfile
import threading
import time
from typing import Any

import yaml

import ladle.kubernetes.kubectl as kubectl
import ladle.kubernetes.status as k8s_status
from ladle.compute.base import ComputeTarget
from ladle.errors import LadleError
from ladle.platform import storage
from ladle.platform.processes import stop_process
from ladle.train.preempt import PREEMPTED

LOG_DRAIN_S = 30.0
"""Seconds a log stream may go on after its job ended before it is stopped."""

CONTAINER = "pytorch"  # the name the training operator looks for
PORT_NAME = "pytorchjob-port"  # the master port the operator reads
LAUNCH = ["ladle", "launch"]  # on the image's PATH (infra/Dockerfile)
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
TRAINER_API = "trainer.kubeflow.org/v1alpha1"
TRAINER_CONTAINER = "node"  # the replicated job and container Trainer's torch plugin configures
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"  # marks the job that TrainJob.spec.trainer fills
RESOURCES = {"trainjob": "trainjobs.trainer.kubeflow.org", "pytorchjob": "pytorchjobs.kubeflow.org"}
KINDS = {"trainjob": "TrainJob", "pytorchjob": "PyTorchJob"}
RUNTIME_RESOURCE = "clustertrainingruntimes.trainer.kubeflow.org"
MISSING = (
    "compute.target = 'kubernetes' submits the training job with kubectl (infra/Dockerfile's image has it); or "
    "print it with `ladle k8s render` and apply it."
)


def job_name(run_name: str) -> str:
    """A DNS-1035 label from the run's name (the operator derives pod and service names from it)."""
    return kubectl.dns_label(run_name, 52)


STOP_MARGIN_S = 30
"""Seconds a training pod is given beyond ``training.preempt_grace_s`` to end once told to stop."""


def requeue_policy() -> dict[str, Any]:
    """The node Job's ``podFailurePolicy``: a pod that ends with ``PREEMPTED`` (75: its ranks were told to stop and
    checkpointed their step) or was disrupted (evicted, preempted, its node drained) is not a failure; the Job
    replaces it without counting it against its backoff limit, and the new pods resume from that checkpoint.
    (A PyTorchJob has no such policy: there the job fails and the train task's retry resumes it.)"""
    return {
        "rules": [
            {
                "action": "Ignore",
                "onExitCodes": {"containerName": TRAINER_CONTAINER, "operator": "In", "values": [PREEMPTED]},
            },
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]},
        ]
    }


def launch_args(spec_url: str, address_var: str, port_var: str) -> list[str]:
    """``ladle launch``'s arguments in a pod: the node rank and rendezvous from the environment the operator
    fills (Kubernetes expands ``$(VAR)`` from the container's environment)."""
    return [
        spec_url,
        "--node-rank",
        "$(PET_NODE_RANK)",
        "--main-address",
        f"$({address_var})",
        "--main-port",
        f"$({port_var})",
    ]


class KubernetesTarget(ComputeTarget):
    name = "kubernetes"
    summary = "a Kubeflow Trainer TrainJob (or a PyTorchJob), submitted and followed with kubectl (`ladle k8s render`)"

    def resources(self, plan) -> dict[str, dict[str, str]] | None:
        """One pod's requests and limits (GPUs, CPU, memory); None when nothing is asked."""
        return kubectl.resources(self.gpus_per_node(plan), self.opts)

    def base_container(self, name: str) -> dict[str, Any]:
        """What every training container has, whichever API runs it: the image, /dev/shm, the env secret."""
        o = self.opts
        container: dict[str, Any] = {
            "name": name,
            "image": o.image,
            "imagePullPolicy": o.image_pull_policy,
            "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
        }
        if o.env_secret:
            container["envFrom"] = [{"secretRef": {"name": o.env_secret}}]
        return container

    def pod_spec(self, container: dict[str, Any]) -> dict[str, Any]:
        """A training pod around ``container``: the in-memory /dev/shm, tolerations, node selector, account."""
        o = self.opts
        pod: dict[str, Any] = {
            "containers": [container],
            "restartPolicy": "Never",  # a failed node fails the job; the train task's retry resumes it
            # Told to stop (SIGTERM: an eviction, a drain, a preemption), the ranks finish their step and checkpoint
            # it within training.preempt_grace_s (ladle.train.preempt); Kubernetes' default 30 s would kill them
            # first. A margin for the processes' exit.
            "terminationGracePeriodSeconds": math.ceil(self.cfg.training.preempt_grace_s) + STOP_MARGIN_S,
            "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": o.shm_size}}],
            **kubectl.placement(o),
        }
        return pod

    def container(self, spec_url: str, plan) -> dict[str, Any]:
        """The PyTorchJob's container: ``ladle launch`` with the operator's environment, its port, resources."""
        container = self.base_container(CONTAINER)
        container.update(
            {
                "command": LAUNCH,
                # Kubernetes expands $(VAR) from the container's environment, which the operator fills.
                "args": launch_args(spec_url, "MASTER_ADDR", "MASTER_PORT"),
                "ports": [{"name": PORT_NAME, "containerPort": self.opts.port, "protocol": "TCP"}],
            }
        )
        if resources := self.resources(plan):
            container["resources"] = resources
        return container

    def pod_template(self, spec_url: str, plan) -> dict[str, Any]:
        pod = self.pod_spec(self.container(spec_url, plan))
        return {"metadata": {"labels": {"app.kubernetes.io/name": "ladle"}}, "spec": pod}

    def render(self, spec_url: str, plan, run_name: str) -> dict[str, Any]:
        """The PyTorchJob that trains ``spec_url``: one master pod and ``nodes - 1`` workers."""
        template = self.pod_template(spec_url, plan)
        replicas = {"Master": {"replicas": 1, "restartPolicy": "Never", "template": template}}
        if plan.num_machines > 1:
            worker = copy.deepcopy(template)  # its own copy: YAML output carries no anchors
            replicas["Worker"] = {"replicas": plan.num_machines - 1, "restartPolicy": "Never", "template": worker}
        return {
            "apiVersion": "kubeflow.org/v1",
            "kind": "PyTorchJob",
            "metadata": {"name": job_name(run_name), "namespace": self.opts.namespace, "labels": self.labels(run_name)},
            "spec": {
                # ladle launch starts the node's ranks itself (accelerate launch), so one process per pod here.
                "nprocPerNode": "1",
                "runPolicy": {"backoffLimit": 0, "cleanPodPolicy": "Running"},
                "pytorchReplicaSpecs": replicas,
            },
        }

    def labels(self, run_name: str) -> dict[str, str]:
        labels = {"app.kubernetes.io/name": "ladle", "app.kubernetes.io/instance": job_name(run_name)}
        if self.opts.queue:
            labels[QUEUE_LABEL] = self.opts.queue
        return labels

    def runtime(self) -> dict[str, Any]:
        """The ``ClusterTrainingRuntime`` a ladle ``TrainJob`` references: the pod-level settings (``/dev/shm``,
        the env secret, tolerations, node selector, service account) in a JobSet of one replicated job ``node``,
        with Trainer's torch policy (the TrainJob asks one process per pod: ``ladle launch`` starts the node's ranks itself).
        Named by a hash of those settings, so configs that differ in them never share (or overwrite) one."""
        pod = self.pod_spec(self.base_container(TRAINER_CONTAINER))
        digest = hashlib.sha256(json.dumps(pod, sort_keys=True).encode()).hexdigest()[:10]
        return {
            "apiVersion": TRAINER_API,
            "kind": "ClusterTrainingRuntime",
            "metadata": {
                "name": f"ladle-torch-{digest}",
                "labels": {"trainer.kubeflow.org/framework": "torch", "app.kubernetes.io/name": "ladle"},
            },
            "spec": {
                "mlPolicy": {
                    "numNodes": 1,
                    "torch": {},
                },  # processes per node: the TrainJob says (1: ladle launch starts them)
                "template": {
                    "spec": {
                        "replicatedJobs": [
                            {
                                "name": TRAINER_CONTAINER,
                                "template": {
                                    "metadata": {"labels": {ANCESTOR_LABEL: "trainer"}},
                                    "spec": {"podFailurePolicy": requeue_policy(), "template": {"spec": pod}},
                                },
                            }
                        ]
                    }
                },
            },
        }

    def render_trainjob(self, spec_url: str, plan, run_name: str) -> list[dict[str, Any]]:
        """The ``TrainJob`` that trains ``spec_url`` on ``nodes`` pods, after the ``ClusterTrainingRuntime`` it
        references. Trainer gives each pod ``PET_NODE_RANK``, ``PET_MASTER_ADDR`` and ``PET_MASTER_PORT``; the
        pod's ``ladle launch`` turns them into the plan's ``accelerate launch`` for that node, as everywhere."""
        runtime = self.runtime()
        resources = self.resources(plan)
        trainer: dict[str, Any] = {
            "image": self.opts.image,
            "command": LAUNCH,
            "args": launch_args(spec_url, "PET_MASTER_ADDR", "PET_MASTER_PORT"),
            "numNodes": plan.num_machines,
            "numProcPerNode": 1,
        }
        if resources:
            trainer["resourcesPerNode"] = resources
        job = {
            "apiVersion": TRAINER_API,
            "kind": "TrainJob",
            "metadata": {"name": job_name(run_name), "namespace": self.opts.namespace, "labels": self.labels(run_name)},
            "spec": {
                "runtimeRef": {
                    "name": runtime["metadata"]["name"],
                    "apiGroup": TRAINER_API.split("/")[0],
                    "kind": "ClusterTrainingRuntime",
                },
                "trainer": trainer,
            },
        }
        return [runtime, job]

    def launch_text(self, plan, spec: str) -> str:
        if self.opts.api == "trainjob":
            objects = self.render_trainjob(spec, plan, self.cfg.name)
            return "ClusterTrainingRuntime and TrainJob:\n" + yaml.safe_dump_all(objects, sort_keys=False)
        return "PyTorchJob:\n" + yaml.safe_dump(self.render(spec, plan, self.cfg.name), sort_keys=False)

    def kubectl(self, *args: str, stdin: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
        return kubectl.run(*args, stdin=stdin, timeout=timeout, missing=MISSING)

    def get_json(self, *args: str) -> dict[str, Any] | None:
        """``kubectl get ... -o json``, parsed; None when kubectl failed (the caller decides what that means)."""
        return kubectl.parsed(self.kubectl("get", *args, "-o", "json"))

    def run(self, spec, on_progress=None, on_line=None, on_command=None):
        from ladle import strategies
        from ladle.train.run import Relay, read_result, write_spec

        api = self.opts.api
        strategies.get(spec.plan.strategy).before_launch(spec.plan)
        relay = Relay(on_progress, on_line)
        with tempfile.TemporaryDirectory(prefix="ladle-k8s-") as tmp:
            write_spec(spec, tmp)  # the run folder is remote (the planner insists), so the pods read it there
            run_name = spec.run_url.rstrip("/").split("/")[-1]
            spec_url = storage.join(spec.run_url, "spec.json")
            if api == "trainjob":
                runtime, job = self.render_trainjob(spec_url, spec.plan, run_name)
                self.ensure_runtime(runtime)
            else:
                job = self.render(spec_url, spec.plan, run_name)
            name, ns = job["metadata"]["name"], job["metadata"]["namespace"]
            resource = RESOURCES[api]
            self.kubectl("delete", resource, name, "-n", ns, "--ignore-not-found", "--wait=true")  # a retry
            done = self.kubectl("apply", "-f", "-", stdin=json.dumps(job))
            if done.returncode != 0:
                raise LadleError(f"kubectl refused the {job['kind']} {ns}/{name}: {done.stderr.strip()}")
            if on_command:
                on_command(f"kubectl apply: {job['kind']} {ns}/{name}, {spec.plan.num_machines} pod(s)")
            try:
                state = self.follow(name, ns, relay)
            except BaseException:  # a deadline, a Prefect cancel, Ctrl-C: nothing is left on the cluster
                self.kubectl("delete", resource, name, "-n", ns, "--ignore-not-found")
                raise
        if state.phase != "succeeded":
            pods = self.get_json("pods", "-n", ns, "-l", self.pod_selector(name)) or {}
            ended = "; ".join([state.why(), *k8s_status.pods_failed(pods)]).strip("; ")
            raise relay.failure(f"{job['kind']} {ns}/{name} ended Failed ({ended or 'no reason given'})")
        return read_result(spec)

    def ensure_runtime(self, runtime: dict[str, Any]) -> None:
        """Create the ClusterTrainingRuntime the TrainJob references unless the cluster has it. Its name is a hash
        of its settings, so one that exists is the one wanted."""
        name = runtime["metadata"]["name"]
        if self.kubectl("get", f"{RUNTIME_RESOURCE}/{name}", "-o", "name").returncode == 0:
            return
        done = self.kubectl("apply", "-f", "-", stdin=json.dumps(runtime))
        if done.returncode != 0:
            raise LadleError(
                f"compute.kubernetes.api = 'trainjob': the cluster has no ClusterTrainingRuntime {name} and kubectl "
                f"could not create it ({done.stderr.strip()}). A cluster-scoped object needs a cluster admin: "
                "apply it once with `ladle k8s render CONFIG --nodes N | kubectl apply -f -`, or bind "
                "infra/k8s/rbac.yaml's ClusterRole to the flow-run pods' service account."
            )

    def pod_selector(self, name: str) -> str:
        label = k8s_status.TRAINJOB_POD_LABEL if self.opts.api == "trainjob" else k8s_status.PYTORCHJOB_POD_LABEL
        return f"{label}={name}"

    POLL_S = 5.0
    """Seconds between looks at the job's status."""

    def follow(self, name: str, ns: str, relay) -> k8s_status.JobState:
        """Follow the job until it succeeds or fails, streaming node rank 0's log while its pod runs.

        The job has ``compute.kubernetes.schedule_timeout_s`` to start running, counted from submission and again
        from each time it stops running without ending (Kueue preempted it: Kueue admits it again by itself when
        quota frees, so ladle waits that long for it). A queue that cannot admit it ends the wait at once.

        Raises:
            LadleError: the job did not run in time, Kueue will not admit it, or it was deleted behind ladle's
                back; the message names the reason the cluster gives and what to change.
        """
        api, resource = self.opts.api, RESOURCES[self.opts.api]
        state_of = k8s_status.trainjob_state if api == "trainjob" else k8s_status.pytorchjob_state
        timeout = self.opts.schedule_timeout_s
        deadline: float | None = time.monotonic() + timeout
        streamed: set[str] = set()  # pods whose log was followed to its end
        evicted: k8s_status.KueueVerdict | None = None
        missing_since: float | None = None
        while True:
            job = self.get_json(resource, name, "-n", ns)
            if job is None:  # kubectl failed: the API server is unreachable for a moment, or the job is gone
                missing_since = missing_since or time.monotonic()
                if time.monotonic() - missing_since > max(timeout, 60):
                    raise LadleError(
                        f"{KINDS[api]} {ns}/{name}: kubectl could not read it for {max(timeout, 60):g} s (deleted "
                        "outside ladle, or the API server is unreachable). Check `kubectl get "
                        f"{resource} -n {ns}` and rerun."
                    )
                time.sleep(self.POLL_S)
                continue
            missing_since = None
            state = state_of(job)
            pods = self.get_json("pods", "-n", ns, "-l", self.pod_selector(name)) or {}
            lead = k8s_status.lead_pod(pods, api)
            if state.phase in ("running", "succeeded", "failed") or k8s_status.pod_started(lead):
                deadline, evicted = None, None
                if lead and k8s_status.pod_started(lead) and self.uid(lead) not in streamed:
                    if self.stream(lead, ns, relay, lambda pod=lead: self.pod_ended(pod, name, ns)):
                        streamed.add(self.uid(lead))
                        continue  # look again at once: the pod's end is the job's news
                    time.sleep(self.POLL_S)  # kubectl could not follow it (yet): not a busy loop
                    continue
            if state.phase in ("succeeded", "failed"):
                return state
            if state.phase == "running" or k8s_status.pod_started(lead):
                time.sleep(self.POLL_S)
                continue
            # Not running: created, waiting for the scheduler or an image, or suspended by Kueue.
            verdict = self.kueue(job, ns) if (self.opts.queue or state.phase == "suspended") else None
            if verdict and verdict.kind == "inadmissible":
                raise LadleError(
                    f"compute.kubernetes.queue = {self.opts.queue!r}: {KINDS[api]} {ns}/{name} cannot be admitted "
                    f"({verdict.why()}); it is deleted. Name a LocalQueue that exists in namespace {ns} and "
                    "points at an active ClusterQueue (`kubectl get localqueues -n NAMESPACE`)."
                )
            if deadline is None:  # it ran and stopped without ending: preempted or evicted
                deadline = time.monotonic() + timeout
                evicted = verdict if verdict and verdict.kind == "evicted" else None
                relay.feed(
                    f"{KINDS[api]} {ns}/{name} stopped running ({(verdict.why() if verdict else state.why()) or state.phase}); "
                    f"waiting up to {timeout:g} s for it to run again\n"
                )
            if time.monotonic() > deadline:
                raise LadleError(self.not_running(name, ns, state, verdict, evicted, pods))
            time.sleep(self.POLL_S)

    def pod_ended(self, pod: dict[str, Any], name: str, ns: str) -> bool:
        """Whether ``pod`` (the one whose log is streamed) has ended or is gone, as the API server says now."""
        pods = self.get_json("pods", "-n", ns, "-l", self.pod_selector(name))
        if pods is None:
            return False  # not known now: the stream goes on
        now = next((p for p in pods.get("items", []) if self.uid(p) == self.uid(pod)), None)
        return now is None or (now.get("status") or {}).get("phase") in ("Succeeded", "Failed")

    @staticmethod
    def uid(pod: dict[str, Any]) -> str:
        meta = pod.get("metadata") or {}
        return meta.get("uid") or meta.get("name", "")

    def stream(self, pod: dict[str, Any], ns: str, relay, ended=lambda: False) -> bool:
        """Feed the pod's log to the relay until the pod's container ends; False when kubectl could not follow
        it (its container not started yet), so the caller looks again. The stream has a deadline: every
        ``POLL_S`` its pod is looked at (``ended``), and once the pod has ended the stream gets ``LOG_DRAIN_S`` to
        finish before it is stopped (a ``kubectl logs -f`` whose connection hung would otherwise hold the stage for
        ever)."""
        proc = subprocess.Popen(
            ["kubectl", "logs", "-f", pod["metadata"]["name"], "-n", ns],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                relay.feed(line)

        reader = threading.Thread(target=read, name="ladle-kubectl-logs", daemon=True)
        reader.start()
        try:
            while reader.is_alive():
                reader.join(timeout=self.POLL_S)
                if reader.is_alive() and ended():
                    reader.join(timeout=LOG_DRAIN_S)
                    if reader.is_alive():
                        relay.feed(f"kubectl logs -f did not end {LOG_DRAIN_S:g} s after the job did; stopped\n")
                        return True
            return proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                stop_process(proc, grace_s=5)

    def kueue(self, job: dict[str, Any], ns: str) -> k8s_status.KueueVerdict | None:
        uid = (job.get("metadata") or {}).get("uid")
        if not uid:
            return None
        workloads = self.get_json("workloads.kueue.x-k8s.io", "-n", ns, "-l", f"{k8s_status.KUEUE_JOB_UID_LABEL}={uid}")
        return k8s_status.kueue_verdict(workloads or {})

    def not_running(self, name, ns, state, verdict, evicted, pods) -> str:
        """The deadline's message: what the job waits for, by the cluster's own words, and what to change."""
        timeout, kind = self.opts.schedule_timeout_s, KINDS[self.opts.api]
        head = f"compute.kubernetes.schedule_timeout_s = {timeout:g}: {kind} {ns}/{name}"
        if evicted:
            return (
                f"{head} was preempted ({evicted.why()}) and not admitted again in {timeout:g} s; it is deleted. "
                "Give it a higher priority (a Kueue WorkloadPriorityClass), submit to a queue with quota to spare "
                "(compute.kubernetes.queue), or raise the timeout; a rerun resumes from the last checkpoint."
            )
        if state.phase == "suspended":
            if verdict:
                return (
                    f"{head} was not admitted in {timeout:g} s ({verdict.why()}); it is deleted. Ask for less "
                    "(compute.kubernetes.gpus_per_node, parallelism.nodes), give the ClusterQueue more quota, "
                    "or raise the timeout."
                )
            return (
                f"{head} stayed suspended for {timeout:g} s with no Kueue Workload for it; it is deleted. Is Kueue "
                "installed, and does compute.kubernetes.queue name a LocalQueue?"
            )
        waiting = "; ".join(k8s_status.pods_waiting(pods))
        if not waiting:
            installed = "Kubeflow Trainer (and JobSet)" if self.opts.api == "trainjob" else "the training operator"
            waiting = f"no pod of it was created: is {installed} installed?"
        return (
            f"{head} did not start running in {timeout:g} s ({waiting}); it is deleted. Free or add what its pods "
            "ask for (compute.kubernetes.gpus_per_node, parallelism.nodes), fix the image, or raise the timeout."
        )
