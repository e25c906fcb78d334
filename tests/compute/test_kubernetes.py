"""Kubernetes: no cluster is reachable here, so every object ladle renders or ships is validated against the
official schemas: the PyTorchJob against its CRD's published OpenAPI schema (pinned in infra/k8s/schemas,
with its source), and every core object (the pods' template, the work pool's Job, the RBAC objects)
against Kubernetes' own schemas in strict mode (kubernetes-validate). The pods' launch resolves to the same
`accelerate launch` the local path runs, and the work-pool template is rendered by Prefect's Kubernetes
worker code and accepted by a real Prefect server."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from ladle import compute
from ladle.config import build_config
from ladle.errors import LadleError
from ladle.machine.topology import probe, probe_file
from ladle.plan.planner import make_plan
from tests.helpers import strict_crd_schema, train_spec

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "infra" / "k8s"
VERSION = "1.33.0"
CRD = strict_crd_schema(K8S / "schemas" / "kubeflow.org_v1_pytorchjob.json")
EIGHT_GPUS = ROOT / "tests" / "machine" / "topo_pastes" / "rtx4090-8-go-gpuallocator-17.txt"


def validate_pytorchjob(job: dict) -> None:
    """The CRD's schema, then each replica's pod template as a core PodTemplate (strict)."""
    jsonschema.validate(job, CRD)
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}}
        kubernetes_validate.validate({**template, "template": replica["template"]}, VERSION, strict=True)


def render_cli(*args: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "ladle.cli.main", "k8s", "render", *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return yaml.safe_load(done.stdout)


def test_the_70b_recipe_renders_a_valid_two_node_pytorchjob():
    job = render_cli(
        "recipes/llama3-70b-fsdp2.yaml",
        "--nodes",
        "2",
        "--topology-file",
        str(EIGHT_GPUS),
        "--gpu-memory",
        "80",
        "--set",
        "output=s3://models/ladle",
        "--run-id",
        "llama-70b-1",
        "--api",
        "pytorchjob",
    )
    validate_pytorchjob(job)
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert (replicas["Master"]["replicas"], replicas["Worker"]["replicas"]) == (1, 1)
    pod = replicas["Worker"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["name"] == "pytorch" and container["ports"][0]["name"] == "pytorchjob-port"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert container["command"] == ["ladle", "launch"]
    assert container["args"][0] == "s3://models/ladle/runs/llama-70b-1/spec.json"
    assert pod["volumes"][0]["emptyDir"]["medium"] == "Memory"
    assert job["metadata"]["name"] == "ladle-llama-70b-1"


def test_schema_validation_catches_a_broken_job():
    cfg = build_config(
        {
            "base": "ladle://tiny-llama",
            "data": {"path": "x"},
            "output": "s3://b/p",
            "compute": {"target": "kubernetes"},
        },
        [],
    )
    job = compute.get(cfg).render("s3://b/p/spec.json", make_plan(cfg, probe(env={}, query_output="")), "run")
    validate_pytorchjob(job)
    broken = copy.deepcopy(job)
    broken["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"] = "one"
    with pytest.raises(jsonschema.ValidationError, match="'one' is not of type 'integer'"):
        validate_pytorchjob(broken)
    typo = copy.deepcopy(job)
    typo["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError), match="imagePullPolicyy"):
        validate_pytorchjob(typo)


def test_each_pod_runs_the_launch_the_local_path_runs(tmp_path):
    """The pod's `ladle launch` args, with the operator's environment filled in, start exactly the argv that
    a machine joining by hand (`ladle launch SPEC --node-rank R`) starts."""
    cfg = build_config(
        {
            "base": "ladle://tiny-llama",
            "data": {"path": "ladle://demo-alpaca", "seq_len": 128},
            "output": "s3://models/ladle",
            "parallelism": {"nodes": 2, "cpu_processes": 2},
            "compute": {"target": "kubernetes"},
        },
        [],
    )
    spec = train_spec(cfg, tmp_path, "k8s")
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(spec.model_dump_json(), encoding="utf-8")
    job = compute.get(cfg).render(str(spec_file), spec.plan, "k8s")
    validate_pytorchjob(job)
    operator_env = {"PET_NODE_RANK": "1", "MASTER_ADDR": "ladle-k8s-master-0", "MASTER_PORT": "29500"}
    args = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["args"]
    for name, value in operator_env.items():
        args = [a.replace(f"$({name})", value) for a in args]
    done = subprocess.run(
        [sys.executable, "-m", "ladle.cli.main", "launch", *args, "--print-command"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr
    pod_argv = json.loads(done.stdout.strip().splitlines()[-1])
    local = spec.plan.launcher_argv(
        [str(spec_file)], machine_rank=1, main_address="ladle-k8s-master-0", main_port=29500
    )
    assert pod_argv == local
    assert pod_argv[pod_argv.index("--num_machines") + 1] == "2"
    assert pod_argv[pod_argv.index("--machine_rank") + 1] == "1"


def test_the_work_pool_template_renders_through_prefects_worker_and_a_server_accepts_it(prefect_harness):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    template = json.loads((K8S / "work-pool-template.json").read_text())
    jsonschema.Draft202012Validator.check_schema(template["variables"])
    values = {"gpus": 8, "image": "registry.example/ladle:1", "node_selector": {"gpu": "h100"}, "namespace": "ml"}
    config = asyncio.run(KubernetesWorkerJobConfiguration.from_template_and_values(template, values))
    manifest = copy.deepcopy(config.job_manifest)
    pod = manifest["spec"]["template"]["spec"]
    # Prefect's worker insists on these two Job fields under the pod spec (its own template has them there);
    # the API server ignores them. Everything else must be a valid batch/v1 Job.
    assert (pod.pop("completions"), pod.pop("parallelism")) == (1, 1)
    kubernetes_validate.validate(manifest, VERSION, strict=True)
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert container["envFrom"] == [{"secretRef": {"name": "ladle-env", "optional": True}}]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert pod["nodeSelector"] == {"gpu": "h100"} and pod["serviceAccountName"] == "ladle"

    async def create_and_read() -> dict:
        async with get_client() as client:
            await client.create_work_pool(
                WorkPoolCreate(name="ladle-k8s", type="kubernetes", base_job_template=template), overwrite=True
            )
            return (await client.read_work_pool("ladle-k8s")).base_job_template

    assert asyncio.run(create_and_read()) == template


def test_rbac_objects_are_valid_and_grant_what_the_train_stage_calls():
    objects = list(yaml.safe_load_all((K8S / "rbac.yaml").read_text()))
    for obj in objects:
        kubernetes_validate.validate(obj, VERSION, strict=True)
    granted = {
        (resource, verb)
        for obj in objects
        if obj["kind"] in ("Role", "ClusterRole")
        for rule in obj["rules"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    needed = {("trainjobs", v) for v in ("create", "get", "delete")} | {("pytorchjobs", v) for v in ("create", "get")}
    needed |= {("pods", "list"), ("pods/log", "get"), ("workloads", "list"), ("clustertrainingruntimes", "create")}
    needed |= {("deployments", v) for v in ("create", "get", "patch")} | {
        ("replicasets", "list"),
        ("services", "patch"),
    }
    needed |= {("inferenceservices", v) for v in ("create", "get", "patch")}
    assert needed <= granted, needed - granted


def test_render_refuses_a_local_output_folder(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "ladle.cli.main", "k8s", "render", "recipes/tiny-cpu.yaml", "--nodes", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "output = './runs/tiny-cpu': pods cannot read or write this machine's folders" in done.stderr


def test_a_recorded_topology_plans_the_nodes(tmp_path):
    cfg = build_config(
        {
            "base": "ladle://tiny-llama",
            "data": {"path": "x"},
            "output": "s3://b/p",
            "parallelism": {"nodes": 4},
            "compute": {"target": "kubernetes"},
        },
        [],
    )
    plan = make_plan(cfg, probe_file(str(EIGHT_GPUS), gpu_memory_gib=24))
    assert (plan.num_machines, plan.processes_per_machine, plan.world_size) == (4, 8, 32)
    assert any("compute target kubernetes" in r for r in plan.reasons)


def test_a_pytorchjob_that_never_starts_is_deleted_at_its_deadline_with_the_pods_reason(tmp_path, monkeypatch):
    """compute.kubernetes.api=pytorchjob: the job stays Created, its master pod unschedulable (recorded, see
    k8s_recorded/SOURCES.md). The train stage ends at compute.kubernetes.schedule_timeout_s, names the
    scheduler's message, and deletes the job."""
    from tests.kubernetes.test_follow import follow, verbs

    outcome, calls, _, took = follow(tmp_path, monkeypatch, "pytorchjob_unschedulable", timeout_s=1, api="pytorchjob")
    assert isinstance(outcome, LadleError) and took < 120  # ends at the deadline, not never
    message = str(outcome)
    assert message.startswith("compute.kubernetes.schedule_timeout_s = 1: PyTorchJob default/ladle-k8s")
    assert "did not start running in 1 s (ladle-k8s-master-0: Unschedulable: 0/9 nodes are available" in message
    assert [c["stdin"]["kind"] for c in calls if c["argv"][0] == "apply"] == ["PyTorchJob"]
    assert verbs(calls)[-1] == "delete pytorchjobs.kubeflow.org"


TRAINJOB_CRD = strict_crd_schema(K8S / "schemas" / "trainer.kubeflow.org_v1alpha1_trainjob.json")
RUNTIME_CRD = strict_crd_schema(K8S / "schemas" / "trainer.kubeflow.org_v1alpha1_clustertrainingruntime.json")


def validate_trainjob(runtime: dict, job: dict) -> None:
    """Trainer v2.3's CRD schemas for both, the runtime's pod template as a core PodTemplate (strict), and the
    reference between them."""
    jsonschema.validate(runtime, RUNTIME_CRD)
    jsonschema.validate(job, TRAINJOB_CRD)
    (replicated,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}}
    kubernetes_validate.validate(
        {**template, "template": replicated["template"]["spec"]["template"]}, VERSION, strict=True
    )
    assert job["spec"]["runtimeRef"]["name"] == runtime["metadata"]["name"]


def test_the_trainjob_and_its_runtime_are_valid_and_each_pod_runs_the_local_launch(tmp_path):
    """`ladle k8s render --api trainjob`: a Kubeflow Trainer v2.3 TrainJob (GPUs per node, Kueue's queue label)
    and the ClusterTrainingRuntime it references (/dev/shm, the env secret, tolerations), valid against the
    pinned CRD schemas; Trainer's PET_* environment turns the pod's args into the argv a machine joining by hand
    starts. Broken objects are caught."""
    runtime, job = yaml.safe_load_all(
        subprocess.run(
            [sys.executable, "-m", "ladle.cli.main", "k8s", "render", "recipes/llama3-70b-fsdp2.yaml", "--nodes", "2",
             "--topology-file", str(EIGHT_GPUS), "--gpu-memory", "80", "--set", "output=s3://models/ladle",
             "--set", "compute.kubernetes.queue=team-a", "--api", "trainjob", "--run-id", "llama-70b-1"],
            capture_output=True, text=True, timeout=120, check=True,
        ).stdout
    )  # fmt: skip
    validate_trainjob(runtime, job)
    trainer = job["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (2, 1)
    assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == "8"
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    pod = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["containers"][0]["envFrom"] == [{"secretRef": {"name": "ladle-env"}}]
    assert pod["volumes"][0]["emptyDir"]["medium"] == "Memory"
    # Told to stop, a pod has training.preempt_grace_s (120) and a margin to checkpoint its step; a pod that ends
    # 75 (it checkpointed) or was disrupted is replaced without counting as a failure, and resumes.
    assert pod["terminationGracePeriodSeconds"] == 150
    rules = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"]["rules"]
    assert rules == [
        {"action": "Ignore", "onExitCodes": {"containerName": "node", "operator": "In", "values": [75]}},
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]},
    ]

    broken = copy.deepcopy(job)
    broken["spec"]["trainer"]["numNodes"] = "two"
    with pytest.raises(jsonschema.ValidationError, match="'two' is not of type 'integer'"):
        validate_trainjob(runtime, broken)
    unknown = copy.deepcopy(job)
    unknown["spec"]["trainer"]["numNode"] = 2  # a typo the API server's strict field validation refuses
    with pytest.raises(jsonschema.ValidationError, match="'numNode' was unexpected"):
        validate_trainjob(runtime, unknown)
    typo = copy.deepcopy(runtime)
    typo["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0][
        "imagePullPolicyy"
    ] = "Always"
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError), match="imagePullPolicyy"):
        validate_trainjob(typo, job)

    cfg = build_config(
        {
            "base": "ladle://tiny-llama",
            "data": {"path": "ladle://demo-alpaca", "seq_len": 128},
            "output": "s3://models/ladle",
            "parallelism": {"nodes": 2, "cpu_processes": 2},
            "compute": {"target": "kubernetes", "kubernetes": {"api": "trainjob"}},
        },
        [],
    )
    spec = train_spec(cfg, tmp_path, "k8s")
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(spec.model_dump_json(), encoding="utf-8")
    runtime, job = compute.get(cfg).render_trainjob(str(spec_file), spec.plan, "k8s")
    validate_trainjob(runtime, job)
    trainer_env = {"PET_NODE_RANK": "1", "PET_MASTER_ADDR": "ladle-k8s-node-0-0.ladle-k8s", "PET_MASTER_PORT": "29400"}
    args = job["spec"]["trainer"]["args"]
    for name, value in trainer_env.items():
        args = [a.replace(f"$({name})", value) for a in args]
    done = subprocess.run(
        [sys.executable, "-m", "ladle.cli.main", "launch", *args, "--print-command"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    local = spec.plan.launcher_argv(
        [str(spec_file)], machine_rank=1, main_address="ladle-k8s-node-0-0.ladle-k8s", main_port=29400
    )
    assert json.loads(done.stdout.strip().splitlines()[-1]) == local
