"""Config sections of where things run: the artifact store's deadlines and the compute targets (Slurm,
Kubernetes)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator

from ladle.pluggable import Registry
from ladle.section import Section


def slurm_seconds(text: str) -> int | None:
    """A Slurm ``--time`` value in seconds (None: unlimited): minutes, MM:SS, HH:MM:SS, D-HH[:MM[:SS]]."""
    text = text.strip()
    if text in ("UNLIMITED", "INFINITE"):
        return None
    days, _, rest = text.rpartition("-") if "-" in text else ("", "", text)
    parts = [int(p) for p in rest.split(":")]
    if days:
        hours, minutes, seconds = (parts + [0, 0])[:3]
        return ((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds
    if len(parts) == 1:
        return parts[0] * 60
    if len(parts) == 2:
        return parts[0] * 60 + parts[1]
    return (parts[0] * 60 + parts[1]) * 60 + parts[2]


SLURM_TIME = re.compile(r"^(UNLIMITED|INFINITE|\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+(:\d{1,2}(:\d{1,2})?)?)$")


class StorageConfig(Section):
    connect_timeout_s: float = Field(
        10.0, gt=0, le=600, description="Deadline to connect to an object store (s3://), per try."
    )
    read_timeout_s: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="Deadline for an object store's answer once connected, per try. A store that accepts "
        "connections and never answers is reported after about (retries + 1) x this (fsspec's own defaults "
        "held one request for minutes); the stage fails with one error naming this field.",
    )
    retries: int = Field(
        2,
        ge=0,
        le=10,
        description="Retries of a failed object-store request (botocore's standard mode: backoff, throttling "
        "retried too). Set for ladle and the processes it starts.",
    )


class SlurmConfig(Section):
    partition: str | None = Field(None, description="`--partition`. null: the cluster's default partition.")
    account: str | None = Field(None, description="`--account`. null: the user's default account.")
    qos: str | None = Field(None, description="`--qos`. null: the default QOS.")
    time_limit: str = Field(
        "04:00:00",
        description="`--time`: minutes, MM:SS, HH:MM:SS or D-HH[:MM[:SS]]. A job that reaches it is stopped; "
        "the train task's retry resumes from the last checkpoint.",
    )
    gpus_per_node: int | None = Field(
        None,
        ge=0,
        le=64,
        description="`--gres=gpu:N` per node. null: the plan's processes per node on a GPU run, none on a CPU run.",
    )
    cpus_per_task: int | None = Field(
        None, ge=1, le=1024, description="`--cpus-per-task` (one task per node). null: Slurm's default."
    )
    python: str | None = Field(
        None,
        description="Python with ladle installed on the compute nodes. null: the interpreter running the "
        "pipeline (the same path must exist on the nodes: a shared file system or the same image).",
    )
    setup: list[str] = Field(
        default_factory=list,
        description="Shell lines each job runs before training, e.g. `module load cuda/12.4` or "
        "`source /shared/venv/bin/activate`.",
    )
    sbatch_args: list[str] = Field(
        default_factory=list,
        description="More `sbatch` options, one per item, e.g. `--exclusive` or `--constraint=h100`.",
    )
    log_dir: str | None = Field(
        None,
        description="Folder for the batch script and the job's output, which the pipeline follows: it must be "
        "readable here and writable by the nodes. null: `slurm/` in the run folder (a local output folder).",
    )
    poll_interval_s: float = Field(2.0, gt=0, le=300, description="Seconds between looks at the job and its log.")
    pending_timeout_s: float = Field(
        0.0,
        ge=0,
        description="Seconds a job may wait in the queue before it is cancelled. 0: wait as long as it takes.",
    )

    @field_validator("time_limit")
    @classmethod
    def _slurm_time(cls, value: str) -> str:
        if not SLURM_TIME.match(value.strip()):
            raise ValueError("use minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS (Slurm's --time formats)")
        return value.strip()

    @field_validator("sbatch_args")
    @classmethod
    def _options_only(cls, value: list[str]) -> list[str]:
        bad = [arg for arg in value if not arg.startswith("-") or "\n" in arg]
        if bad:
            raise ValueError(f"{bad[0]!r} is not one sbatch option: write each as `--name=value` on its own")
        return value


class KubernetesPods(Section):
    """What every pod ladle puts on a cluster carries, training or serving."""

    namespace: str = Field("default", description="Namespace of the objects.")
    image: str = Field(
        "ladle:latest", description="The pods' image (built from infra/Dockerfile and pushed where the cluster pulls)."
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="The containers' `imagePullPolicy`."
    )
    cpu: str | None = Field(None, description="CPU request and limit per pod, e.g. `32`. null: none set.")
    memory: str | None = Field(None, description="Memory request and limit per pod, e.g. `480Gi`. null: none set.")
    service_account: str | None = Field(None, description="Pods' service account. null: the namespace's default.")
    env_secret: str | None = Field(
        "ladle-env",
        description="Secret whose keys become the pods' environment (AWS_* for the artifact store, "
        "MLFLOW_TRACKING_URI and its credentials, a serving API key). null: none.",
    )
    node_selector: dict[str, str] = Field(default_factory=dict, description="Pods' `nodeSelector`.")
    tolerations: list[dict[str, Any]] = Field(
        default_factory=lambda: [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        description="Pods' tolerations (default: GPU nodes' usual taint).",
    )


class KubernetesConfig(KubernetesPods):
    api: Literal["trainjob", "pytorchjob"] = Field(
        "trainjob",
        description="The training job's API: `trainjob` (Kubeflow Trainer v2.3, `trainer.kubeflow.org/v1alpha1`: a "
        "TrainJob and the ClusterTrainingRuntime it references, which the train stage creates when the cluster lacks "
        "it) or `pytorchjob` (the Kubeflow training operator 1.9's `kubeflow.org/v1`, deprecated upstream).",
    )
    queue: str | None = Field(
        None, description="Kueue LocalQueue to submit to (the `kueue.x-k8s.io/queue-name` label). null: no queue."
    )
    gpus_per_node: int | None = Field(
        None,
        ge=0,
        le=64,
        description="`nvidia.com/gpu` per pod (one pod per node). null: the plan's processes per node on a GPU run.",
    )
    shm_size: str = Field(
        "16Gi", description="Size of the in-memory /dev/shm (NCCL and data loaders need more than the 64 MiB default)."
    )
    port: int = Field(29500, ge=1, le=65535, description="Rendezvous port on the master pod.")
    schedule_timeout_s: float = Field(
        1800.0,
        gt=0,
        le=7 * 86400,
        description="Seconds the training job may wait to start running (pods unschedulable, images pulling, "
        "a queue) before it is deleted and the train stage fails naming the pods' reason.",
    )


TARGETS: Registry = Registry("compute target", "compute.target", shipped="ladle.compute")
"""The compute targets by name (``ladle.pluggable``'s shape, shared with the strategies and the serving backends):
``ComputeTarget`` subclasses, registered by ``ladle.compute`` when it is imported. It lives with the config
because the targets run what the config plans (they import it); the config only reads their names."""

TARGET_PREAMBLE = "Where training runs. "


class ComputeConfig(Section):
    target: str = Field(
        "local",
        description=TARGET_PREAMBLE + "Any registered compute target (`ladle schema --markdown` lists them).",
        json_schema_extra=TARGETS.schema(TARGET_PREAMBLE),
    )
    slurm: SlurmConfig = Field(default_factory=SlurmConfig, description="Options of target slurm.")
    kubernetes: KubernetesConfig = Field(default_factory=KubernetesConfig, description="Options of target kubernetes.")

    _known_target = field_validator("target", mode="before")(TARGETS.validator())
