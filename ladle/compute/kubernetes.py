"""``compute.target: kubernetes``: multi-node training as a Kubeflow ``PyTorchJob`` (``kubeflow.org/v1``).

Why PyTorchJob and not Kubeflow Trainer's ``TrainJob``: a PyTorchJob carries whole pod templates, so
everything a training pod needs (GPU limits, the in-memory /dev/shm, tolerations, the secret with the
artifact store's and MLflow's settings) is plain Kubernetes inside one object, and it runs on the training
operator alone. A ``TrainJob`` needs a ``ClusterTrainingRuntime`` installed beside it whose launcher (its
own torchrun) ladle would have to override. The operator gives every pod ``PET_NODE_RANK`` (master 0,
worker i → i + 1), ``MASTER_ADDR`` (the master pod's service) and ``MASTER_PORT``; each pod runs
``ladle launch`` with them, which starts the plan's ``accelerate launch`` for that node: the same launch as
every other target.

``render`` is pure (tested against the CRD's and Kubernetes' published schemas); ``run`` submits with
``kubectl`` and follows the job until it succeeds or fails.
"""

from __future__ import annotations

import copy
import hashlib
import json
import subprocess
import tempfile
import time
from typing import Any

import yaml

from ladle import storage
from ladle.compute.base import ComputeTarget
from ladle.errors import LadleError

CONTAINER = "pytorch"  # the name the training operator looks for
PORT_NAME = "pytorchjob-port"  # the master port the operator reads
LAUNCH = ["ladle", "launch"]  # on the image's PATH (infra/Dockerfile)
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
TRAINER_API = "trainer.kubeflow.org/v1alpha1"
TRAINER_CONTAINER = "node"  # the replicated job and container Trainer's torch plugin configures
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"  # marks the job that TrainJob.spec.trainer fills


def job_name(run_name: str) -> str:
    """A DNS-1035 label from the run's name (the operator derives pod and service names from it)."""
    clean = "".join(c if c.isalnum() else "-" for c in run_name.lower()).strip("-")
    return ("ladle-" + clean)[:52].rstrip("-")


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

    def resources(self, plan) -> dict[str, dict[str, str]] | None:
        """One pod's requests and limits (GPUs, CPU, memory); None when nothing is asked."""
        o = self.opts
        limits: dict[str, str] = {}
        if self.gpus_per_node(plan):
            limits["nvidia.com/gpu"] = str(self.gpus_per_node(plan))
        limits.update({k: v for k, v in (("cpu", o.cpu), ("memory", o.memory)) if v})
        return {"limits": limits, "requests": dict(limits)} if limits else None

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
            "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": o.shm_size}}],
        }
        if o.tolerations:
            pod["tolerations"] = o.tolerations
        if o.node_selector:
            pod["nodeSelector"] = o.node_selector
        if o.service_account:
            pod["serviceAccountName"] = o.service_account
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
        with Trainer's torch policy (one process per pod: ``ladle launch`` starts the node's ranks itself).
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
                "mlPolicy": {"numNodes": 1, "torch": {"numProcPerNode": 1}},
                "template": {
                    "spec": {
                        "replicatedJobs": [
                            {
                                "name": TRAINER_CONTAINER,
                                "template": {
                                    "metadata": {"labels": {ANCESTOR_LABEL: "trainer"}},
                                    "spec": {"template": {"spec": pod}},
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
        try:
            return subprocess.run(
                ["kubectl", *args], input=stdin, capture_output=True, text=True, timeout=timeout, check=False
            )
        except FileNotFoundError:
            raise LadleError(
                "compute.target = 'kubernetes': kubectl not found on PATH. The train stage submits the PyTorchJob "
                "with kubectl (infra/Dockerfile's image has it); or print it with `ladle k8s render` and apply it."
            ) from None

    def run(self, spec, on_progress=None, on_line=None, on_command=None):
        from ladle import strategies
        from ladle.train.run import Relay, read_result, write_spec

        if self.opts.api == "trainjob":
            raise LadleError(
                "compute.kubernetes.api = 'trainjob': the train stage submits and follows PyTorchJobs only so far. "
                "Print the TrainJob with `ladle k8s render CONFIG --nodes N --api trainjob` and apply it, or set "
                "compute.kubernetes.api: pytorchjob."
            )
        strategies.get(spec.plan.strategy).before_launch(spec.plan)
        relay = Relay(on_progress, on_line)
        with tempfile.TemporaryDirectory(prefix="ladle-k8s-") as tmp:
            write_spec(spec, tmp)  # the run folder is remote (the planner insists), so the pods read it there
            run_name = spec.run_url.rstrip("/").split("/")[-1]
            job = self.render(storage.join(spec.run_url, "spec.json"), spec.plan, run_name)
            name, ns = job["metadata"]["name"], job["metadata"]["namespace"]
            self.kubectl("delete", "pytorchjob", name, "-n", ns, "--ignore-not-found", "--wait=true")  # a retry
            done = self.kubectl("apply", "-f", "-", stdin=json.dumps(job))
            if done.returncode != 0:
                raise LadleError(f"kubectl refused the PyTorchJob {name}: {done.stderr.strip()}")
            if on_command:
                on_command(f"kubectl apply: PyTorchJob {ns}/{name}, {spec.plan.num_machines} pod(s)")
            try:
                state = self.follow(name, ns, relay)
            except BaseException:
                self.kubectl("delete", "pytorchjob", name, "-n", ns, "--ignore-not-found")
                raise
        if state != "Succeeded":
            raise relay.failure(f"PyTorchJob {ns}/{name} ended {state}")
        return read_result(spec)

    POLL_S = 5.0
    """Seconds between looks at the job's status."""

    def follow(self, name: str, ns: str, relay) -> str:
        """Stream the master pod's log until the job's last condition is Succeeded or Failed.

        Raises:
            LadleError: the job did not start running within ``compute.kubernetes.schedule_timeout_s`` (the
                caller deletes it), naming what its pods wait for.
        """
        pod = f"{name}-master-0"
        logs = None
        deadline = time.monotonic() + self.opts.schedule_timeout_s
        while True:
            got = self.kubectl("get", "pytorchjob", name, "-n", ns, "-o", "json")
            conditions = json.loads(got.stdout).get("status", {}).get("conditions", []) if got.returncode == 0 else []
            state = conditions[-1]["type"] if conditions else "Created"
            if logs is None and state in ("Running", "Succeeded", "Failed"):
                logs = subprocess.Popen(
                    ["kubectl", "logs", "-f", pod, "-n", ns],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
                assert logs.stdout is not None
                for line in logs.stdout:
                    relay.feed(line)
                if logs.wait() != 0 and state == "Running":
                    logs = None  # the pod was not ready for its log yet: look again
            if state in ("Succeeded", "Failed"):
                return state
            if state not in ("Running", "Restarting") and time.monotonic() > deadline:
                timeout = self.opts.schedule_timeout_s
                raise LadleError(
                    f"compute.kubernetes.schedule_timeout_s = {timeout:g}: PyTorchJob {ns}/{name} did not start "
                    f"running in {timeout:g} s ({self.waiting_for(name, ns)}); it is deleted. Free or add what its "
                    "pods ask for (compute.kubernetes.gpus_per_node, parallelism.nodes), fix the image, or raise "
                    "the timeout."
                )
            time.sleep(self.POLL_S)

    def waiting_for(self, name: str, ns: str) -> str:
        """What the job's pods wait for, from their status: the scheduler's message, or a container's reason."""
        got = self.kubectl("get", "pods", "-n", ns, "-l", f"training.kubeflow.org/job-name={name}", "-o", "json")
        pods = json.loads(got.stdout).get("items", []) if got.returncode == 0 and got.stdout.strip() else []
        reasons = []
        for pod in pods:
            status, pod_name = pod.get("status", {}), pod.get("metadata", {}).get("name", "?")
            for condition in status.get("conditions", []):
                if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
                    reasons.append(f"{pod_name}: {condition.get('reason')}: {condition.get('message', '')}".strip())
            for container in status.get("containerStatuses", []):
                waiting = container.get("state", {}).get("waiting")
                if waiting:
                    reasons.append(f"{pod_name}: {waiting.get('reason')}: {waiting.get('message', '')}".strip())
        return "; ".join(reasons) or "no pod of it was created: is the training operator installed?"
