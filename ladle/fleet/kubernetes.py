"""``serve.target: kubernetes``: the registered model's champion served by Kubernetes itself.

``render`` gives the objects that serve one registered version with ladle's server (``python -m ladle.serve``, the
same server as on one machine): a Deployment and a Service, or a KServe ``InferenceService`` whose predictor is
that server (``serve.kubernetes.kind``). Each pod copies the version from the artifact store (its ``source``,
keyed by its hash) and serves it. Kubernetes owns what ladle's front does on one machine:

* **readiness** on ``/ready`` (a pod takes traffic once its model answers), **liveness** on ``/health`` (a hung
  server is restarted), a **startup** probe sized by ``startup_timeout_s`` (copying and loading the weights);
* **rolling updates** with ``maxUnavailable: 0``: a new version's pods must be ready before an old one goes, so a
  swap fails no request; a ``preStop`` pause lets the Service stop routing to a pod before it drains (SIGTERM:
  in-flight requests finish within ``serve.drain_timeout_s``);
* **metrics**: Prometheus' scrape annotations point at ``/metrics``.

``reconcile`` is what a promotion or a rollback does (the serving deployment's run, ``ladle model serve``): it
applies the objects for the current ``champion`` and waits for the rollout. A version whose pods do not become
ready within ``rollout_timeout_s`` never takes traffic: ladle puts the previous version back (``kubectl rollout
undo``; for an InferenceService, the previous spec) and fails naming the pods' reason.
"""

from __future__ import annotations

import json
import math
import subprocess
import time
from typing import Any

import ladle.kubernetes.kubectl as kubectl
import ladle.kubernetes.status as k8s_status
from ladle.config import ServeConfig
from ladle.errors import LadleError
from ladle.fleet.deploy import SwapFailed, server_argv
from ladle.lifecycle import promote
from ladle.platform import storage
from ladle.platform.secrets import redact_url
from ladle.serve import backends

VERSION_ANNOTATION = "ladle.dev/model-version"
ACCESS_ANNOTATION = "ladle.dev/access"
ACCESS = {
    "namespace": "pods of this namespace only (NetworkPolicy)",
    "api_key": "requests with the API key of serve.api_key_env",
    "open": "anyone who reaches the pods (serve.kubernetes.access open)",
}
"""What the objects say about who may call the server (``serve.kubernetes.access``)."""
MODEL_ANNOTATION = "ladle.dev/model"
INSTANCE_LABEL = "app.kubernetes.io/instance"
CONTAINER = "kserve-container"  # the name KServe gives a custom predictor's container; harmless for a Deployment
KSERVE_API = "serving.kserve.io/v1beta1"
RESOURCES = {"deployment": "deployments.apps", "inferenceservice": "inferenceservices.serving.kserve.io"}
MISSING = (
    "serve.target = 'kubernetes' applies the serving objects with kubectl; or print them with "
    "`ladle k8s render-serving MODEL` and apply them."
)


def object_name(model: str) -> str:
    """A DNS-1035 label from the registered model's name (KServe adds ``-predictor-...`` to it: kept short)."""
    return kubectl.dns_label(model, 40)


def gpus(cfg: ServeConfig) -> int:
    """GPUs per pod: as configured, else what the backend takes (a sharding backend: tensor_parallel GPUs per
    replica; another CUDA backend: one; a backend that runs on CPU: none)."""
    if cfg.kubernetes.gpus is not None:
        return cfg.kubernetes.gpus
    kind = backends.get(cfg.backend)
    if not kind.requires_cuda:
        return 0
    return max(cfg.tensor_parallel, 1) * cfg.replica_num if kind.shards_model else 1


class KubernetesServing:
    """The serving objects of one registered model, and the rollout of a version into them."""

    def __init__(self, name: str, cfg: ServeConfig) -> None:
        self.model, self.cfg, self.opts = name, cfg, cfg.kubernetes
        self.name = object_name(name)
        self.resource = RESOURCES[self.opts.kind]

    # ----- rendering (pure) -----

    def container(self, version: promote.Version) -> dict[str, Any]:
        """ladle's server for ``version``: the argv the local path starts, in the pod, on all addresses."""
        o, cfg = self.opts, self.cfg
        argv = server_argv(version.source, self.model, cfg.model_copy(update={"host": "0.0.0.0"}), o.port)  # noqa: S104
        if storage.is_local(version.source):
            raise LadleError(
                f"output: v{version.version} of {self.model} is at {version.source}, a path on this machine, which no "
                "pod can read. Serve on Kubernetes a version trained with `output` on a store the pods reach "
                "(s3://..., gs://...), or copy its folder there and register that copy."
            )
        sha = version.tags.get("ladle.model_sha256")
        if sha is not None:
            try:
                storage.cache_key(sha, f"v{version.version}'s tag ladle.model_sha256")  # it names the pod's copy
            except ValueError as exc:
                raise LadleError(str(exc)) from None
        http = {"port": o.port, "path": ""}
        probe_period = 10
        container: dict[str, Any] = {
            "name": CONTAINER,
            "image": o.image,
            "imagePullPolicy": o.image_pull_policy,
            "command": ["python", "-m", "ladle.serve"],
            "args": argv[3:] + (["--model-sha256", sha] if sha else []),
            "ports": [{"name": "http", "containerPort": o.port, "protocol": "TCP"}],
            "startupProbe": {
                "httpGet": {**http, "path": "/health"},
                "periodSeconds": probe_period,
                "failureThreshold": max(1, math.ceil(o.startup_timeout_s / probe_period)),
            },
            "readinessProbe": {"httpGet": {**http, "path": "/ready"}, "periodSeconds": 5, "failureThreshold": 3},
            "livenessProbe": {
                "httpGet": {**http, "path": "/health"},
                "periodSeconds": probe_period,
                "timeoutSeconds": 5,
                "failureThreshold": 3,
            },
            # The Service keeps routing to a terminating pod until its endpoints update: pause before the SIGTERM.
            "lifecycle": {"preStop": {"sleep": {"seconds": 5}}},
            "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
        }
        if o.env_secret:
            container["envFrom"] = [{"secretRef": {"name": o.env_secret}}]
        if resources := kubectl.resources(gpus(cfg), o):
            container["resources"] = resources
        return container

    def pod_fields(self) -> dict[str, Any]:
        """The pod-level settings both kinds carry (a Deployment's pod spec; an InferenceService's predictor)."""
        o = self.opts
        pod: dict[str, Any] = {
            "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}],
            "terminationGracePeriodSeconds": int(self.cfg.drain_timeout_s) + 15,
            **kubectl.placement(o),
        }
        return pod

    def metadata(self, version: promote.Version) -> dict[str, Any]:
        return {
            "name": self.name,
            "namespace": self.opts.namespace,
            "labels": {"app.kubernetes.io/name": "ladle", INSTANCE_LABEL: self.name},
            "annotations": {MODEL_ANNOTATION: self.model, VERSION_ANNOTATION: str(version.version)},
        }

    def scrape(self) -> dict[str, str]:
        return {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(self.opts.port),
            "prometheus.io/path": "/metrics",
        }

    def render(self, version: promote.Version) -> list[dict[str, Any]]:
        """The objects that serve ``version``: [Deployment, Service] or [InferenceService], and with
        ``serve.kubernetes.access`` namespace the NetworkPolicy that admits only the namespace's pods."""
        objects = self.render_serving(version)
        if self.opts.access == "namespace":
            objects.append(self.network_policy())
        for obj in objects:
            obj["metadata"].setdefault("annotations", {})[ACCESS_ANNOTATION] = ACCESS[self.opts.access]
        return objects

    def network_policy(self) -> dict[str, Any]:
        """Ingress to the server pods from pods of their own namespace only, on the server's port (the kubelet's
        probes are not subject to it)."""
        if self.opts.kind == "inferenceservice":
            pods = {"serving.kserve.io/inferenceservice": self.name}
        else:
            pods = {"app.kubernetes.io/name": "ladle", INSTANCE_LABEL: self.name}
        return {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {
                "name": self.name,
                "namespace": self.opts.namespace,
                "labels": {"app.kubernetes.io/name": "ladle", INSTANCE_LABEL: self.name},
            },
            "spec": {
                "podSelector": {"matchLabels": pods},
                "policyTypes": ["Ingress"],
                "ingress": [{"from": [{"podSelector": {}}], "ports": [{"port": self.opts.port, "protocol": "TCP"}]}],
            },
        }

    def render_serving(self, version: promote.Version) -> list[dict[str, Any]]:
        if self.opts.kind == "inferenceservice":
            return [self.render_inferenceservice(version)]
        labels = {"app.kubernetes.io/name": "ladle", INSTANCE_LABEL: self.name}
        pod = {"containers": [self.container(version)], **self.pod_fields()}
        deployment = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": self.metadata(version),
            "spec": {
                "replicas": self.opts.replicas,
                "selector": {"matchLabels": dict(labels)},
                "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
                "minReadySeconds": 5,
                "progressDeadlineSeconds": max(int(self.opts.rollout_timeout_s), 60),
                "template": {
                    "metadata": {
                        "labels": dict(labels),
                        "annotations": {**self.scrape(), VERSION_ANNOTATION: str(version.version)},
                    },
                    "spec": pod,
                },
            },
        }
        service = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {k: v for k, v in self.metadata(version).items() if k != "annotations"},
            "spec": {
                "selector": dict(labels),
                "ports": [{"name": "http", "port": self.opts.port, "targetPort": "http", "protocol": "TCP"}],
            },
        }
        return [deployment, service]

    def render_inferenceservice(self, version: promote.Version) -> dict[str, Any]:
        """A KServe InferenceService whose predictor is ladle's server (a custom predictor: KServe routes to
        the container's port and probes it as a Deployment would). ``RawDeployment`` mode: a Deployment and a
        Service underneath, no Knative needed; its rollout keeps ``maxUnavailable: 0``."""
        meta = self.metadata(version)
        meta["annotations"] = {
            **meta["annotations"],
            **self.scrape(),
            "serving.kserve.io/deploymentMode": "RawDeployment",
        }
        predictor = {
            "minReplicas": self.opts.replicas,
            "maxReplicas": self.opts.replicas,
            "deploymentStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "containers": [self.container(version)],
            **self.pod_fields(),
        }
        return {
            "apiVersion": KSERVE_API,
            "kind": "InferenceService",
            "metadata": meta,
            "spec": {"predictor": predictor},
        }

    def url(self) -> str:
        """The address clients in the cluster use."""
        if self.opts.kind == "inferenceservice":  # KServe's RawDeployment service is named after the predictor
            return f"http://{self.name}-predictor.{self.opts.namespace}.svc.cluster.local"
        return f"http://{self.name}.{self.opts.namespace}.svc.cluster.local:{self.opts.port}"

    # ----- the rollout (kubectl) -----

    def kubectl(self, *args: str, stdin: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
        return kubectl.run(*args, stdin=stdin, timeout=timeout, missing=MISSING)

    def current(self) -> dict[str, Any] | None:
        """The serving object on the cluster now; None when there is none."""
        got = self.kubectl("get", self.resource, self.name, "-n", self.opts.namespace, "-o", "json")
        if got.returncode != 0:
            if "NotFound" in got.stderr or "not found" in got.stderr:
                return None
            raise LadleError(f"serve.target = 'kubernetes': kubectl could not read {self.name}: {got.stderr.strip()}")
        return json.loads(got.stdout)

    def wait(self) -> tuple[bool, str]:
        """Wait, at most ``rollout_timeout_s``, for the rollout; (done, kubectl's words)."""
        deadline = self.opts.rollout_timeout_s
        ns = self.opts.namespace
        if self.opts.kind == "inferenceservice":
            args = ["wait", "--for=condition=Ready", f"{self.resource}/{self.name}", "-n", ns]
        else:
            args = ["rollout", "status", f"{self.resource}/{self.name}", "-n", ns]
        done = self.kubectl(*args, f"--timeout={int(deadline)}s", timeout=deadline + 30)
        return done.returncode == 0, (done.stdout + done.stderr).strip()

    def pods_reason(self) -> str:
        got = self.kubectl(
            "get", "pods", "-n", self.opts.namespace, "-l", f"{INSTANCE_LABEL}={self.name}", "-o", "json"
        )
        pods = kubectl.parsed(got) or {}
        reasons = k8s_status.pods_waiting(pods) + k8s_status.pods_failed(pods)
        return "; ".join(dict.fromkeys(reasons)) or "no pod reported a reason"

    def put_back(self, previous: dict[str, Any] | None, served: str | None) -> str:
        """Undo a rollout that did not finish: the previous version serves on, its version annotation says so
        again. Only what ladle made is touched: an object that was not there before is deleted; one that was is
        restored. Returns what was done, and what kubectl refused."""
        ns = self.opts.namespace
        if previous is None:
            done = self.kubectl("delete", self.resource, self.name, "-n", ns, "--ignore-not-found")
            return self.said(done, f"nothing served before, so {self.name} (made by this rollout) is deleted")
        if self.opts.kind == "deployment":
            undo = self.kubectl("rollout", "undo", f"{self.resource}/{self.name}", "-n", ns)
            if undo.returncode != 0:
                return self.said(undo, "the Deployment's rollback")
            marked = self.kubectl(
                "annotate", self.resource, self.name, "-n", ns, "--overwrite", f"{VERSION_ANNOTATION}={served}"
            )
            return self.said(marked, f"the Deployment is rolled back to v{served} and annotated so")
        restored = {
            "apiVersion": previous["apiVersion"],
            "kind": previous["kind"],
            "metadata": {
                k: previous["metadata"][k]
                for k in ("name", "namespace", "labels", "annotations")
                if k in previous["metadata"]
            },
            "spec": previous["spec"],
        }
        done = self.kubectl("apply", "-f", "-", stdin=json.dumps(restored))
        return self.said(done, "the InferenceService's previous spec is applied again")

    @staticmethod
    def said(done: subprocess.CompletedProcess, what: str) -> str:
        """``what`` when kubectl did it; else that it failed, in kubectl's words (the caller's error carries it)."""
        if done.returncode == 0:
            return what
        return f"{what} FAILED (kubectl: {(done.stderr or done.stdout).strip()[:300]}); check it by hand"

    def check_ours(self, previous: dict[str, Any] | None) -> None:
        """Refuse to replace an object of the same name that ladle did not make.

        Raises:
            LadleError: naming the object and what to change.
        """
        annotations = ((previous or {}).get("metadata") or {}).get("annotations") or {}
        if previous is None or VERSION_ANNOTATION in annotations:
            return
        raise LadleError(
            f"serve.kubernetes: {previous.get('kind', self.resource)} {self.opts.namespace}/{self.name} exists and was "
            f"not made by ladle (it has no {VERSION_ANNOTATION} annotation), so ladle will neither replace nor "
            "delete it. Delete or rename it, or serve into another namespace (serve.kubernetes.namespace)."
        )

    def roll_out(
        self, objects: list[dict[str, Any]], previous: dict[str, Any] | None, served: str | None
    ) -> tuple[str, str, str] | None:
        """Apply ``objects`` and wait for their rollout: None once it finished, else (the pods' reason, kubectl's
        words, what was done to put ``previous`` back, which served ``served``).

        Raises:
            LadleError: kubectl refused the objects.
        """
        applied = self.kubectl(
            "apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects})
        )
        if applied.returncode != 0:
            raise LadleError(f"serve.target = 'kubernetes': kubectl refused {self.name}: {applied.stderr.strip()}")
        done, said = self.wait()
        if done:
            return None
        reason = self.pods_reason()
        return reason, said, self.put_back(previous, served)

    def reconcile(self, uri: str) -> dict[str, Any]:
        """Make the cluster serve the registry's ``champion``; returns what ``champion.Serving`` reports.

        Raises:
            LadleError: no champion, or kubectl refused the objects.
            SwapFailed: the version's pods did not become ready in time (the previous version serves on).
        """
        started = time.monotonic()
        wanted = promote.champion(uri, self.model)
        if wanted is None:
            raise LadleError(
                f"model {self.model!r} has no `champion` at {redact_url(uri)}: nothing to serve. Run the pipeline "
                "until a version is promoted, or set one with `ladle model rollback NAME --to VERSION`."
            )
        previous = self.current()
        self.check_ours(previous)
        served = ((previous or {}).get("metadata", {}).get("annotations") or {}).get(VERSION_ANNOTATION)
        failed = self.roll_out(self.render(wanted), previous, served)
        if failed is not None:
            reason, said, undone = failed
            was = f"v{served}" if served else "the previous version"
            raise SwapFailed(
                f"{self.model} v{wanted.version} did not become ready on Kubernetes in "
                f"{self.opts.rollout_timeout_s:g} s ({reason}; kubectl: {said[-300:]}), so it takes no traffic: "
                f"{undone}, and {was} keeps serving. Fix what the pods report, or raise "
                "serve.kubernetes.rollout_timeout_s."
            )
        action = "unchanged" if served == str(wanted.version) else ("swapped" if served else "started")
        return {
            "model": self.model,
            "version": str(wanted.version),
            "previous_version": served,
            "action": action,
            "front_url": self.url(),
            "server_url": self.url(),
            "server_pid": 0,
            "seconds": round(time.monotonic() - started, 3),
        }


BINDINGS_ANNOTATION = "ladle.dev/adapters"
"""On a base's serving object: the adapters its pods serve, as JSON ``{adapter name: registered model}``."""
SERVED_ENV = "LADLE_ADAPTER_VERSIONS"
"""In a base's pod: the versions each adapter's aliases named when ladle rolled it out. The pods read the aliases
themselves; a change here rolls the pods, so a promotion reaches every replica through a rollout that must become
ready (and is undone when it does not), never a replica that changed under traffic by itself."""


def pods_base(cfg) -> promote.Version:
    """The config's base as the pods load it (a store URL, and its hash when registered), as a version named
    ``base``.

    Raises:
        LadleError: a base no pod can read (a path or a shipped asset on this machine).
    """
    from ladle.plan.inputs import registered_version

    registered = registered_version(cfg)
    if registered is not None:
        tags = registered.tags
        if tags.get("ladle.kind") == "adapter":
            url, sha = tags.get("ladle.merged_url", ""), tags.get("ladle.merged_sha256")
        else:
            url, sha = registered.source, tags.get("ladle.model_sha256")
    else:
        url, sha = cfg.base, None
    if storage.is_local(url) or url.startswith("ladle://"):
        raise LadleError(
            f"base = {cfg.base!r}: the pods load the base from the artifact store, and {url or '(no merged copy)'} "
            "is not there. Point base at a store URL (s3://..., gs://...) or a registered model whose files are in "
            "the store (models:/NAME@champion)."
        )
    return promote.Version(name="base", version="base", source=url, tags={"ladle.model_sha256": sha} if sha else {})


class KubernetesAdapters(KubernetesServing):
    """A base's server on Kubernetes with the adapters bound to it (``promote.merge: false``): one Deployment
    (or InferenceService) per base, named after its signature like the base's front on one machine, whose pods run
    ``python -m ladle.serve --model BASE --adapter NAME=models:/NAME ...`` and read each adapter's ``champion`` and
    ``challenger`` from the registry when they start (no periodic sync). ``reconcile`` binds one more adapter, or
    rolls the pods when an alias moved; readiness is ``/ready``, which names a version a pod could not load."""

    def __init__(self, base_name: str, cfg: ServeConfig, base: promote.Version, pods_uri: str) -> None:
        super().__init__(base_name, cfg)
        self.base, self.pods_uri = base, pods_uri
        if pods_uri.startswith(("sqlite:", "file:")) or "://" not in pods_uri:
            raise LadleError(
                f"serve.kubernetes.tracking_uri = {redact_url(pods_uri)!r}: the pods read their adapters' aliases from "
                "the registry, and this store is on this machine. Set serve.kubernetes.tracking_uri to the MLflow "
                "server as the pods reach it (http://mlflow.NAMESPACE.svc:5000), or track to such a server."
            )

    def render_adapters(self, bindings: dict[str, str], versions: dict[str, dict[str, str]]) -> list[dict[str, Any]]:
        """The base's objects serving ``bindings`` (adapter -> registered model), whose aliases now name
        ``versions`` (adapter -> alias -> version)."""
        objects = self.render(self.base)
        serving = objects[0]
        pod = serving["spec"]["template"]["spec"] if serving["kind"] == "Deployment" else serving["spec"]["predictor"]
        (container,) = pod["containers"]
        for adapter, registered in sorted(bindings.items()):
            container["args"] += ["--adapter", f"{adapter}=models:/{registered}"]
        container["args"] += ["--tracking-uri", self.pods_uri, "--adapter-sync-s", "0"]
        container["env"] = [{"name": SERVED_ENV, "value": json.dumps(versions, sort_keys=True)}]
        for obj in objects:
            obj["metadata"].setdefault("annotations", {})[BINDINGS_ANNOTATION] = json.dumps(bindings, sort_keys=True)
        return objects

    def reconcile_adapter(self, uri: str, name: str, champion: promote.Version) -> dict[str, Any]:
        """Serve adapter ``name``'s ``champion`` on the base's pods: bound beside the adapters already there, the
        pods rolled when a binding or an alias changed, the rollout waited for; what ``ladle model serve`` reports.

        Raises:
            LadleError: kubectl refused the objects, or the version's files are on this machine.
            SwapFailed: the pods did not become ready in time (the previous pods serve on; the pods' reason named).
        """
        started = time.monotonic()
        if storage.is_local(champion.source):
            raise LadleError(
                f"output: {name} v{champion.version} is at {champion.source}, a path on this machine, which no pod "
                "can read. Serve on Kubernetes an adapter trained with `output` on a store the pods reach (s3://...)."
            )
        previous = self.current()
        self.check_ours(previous)
        bound, before = self.pods_state(previous)  # what the pods run (a rollout undone puts it back too)
        bindings = {**bound, name: name}
        from ladle.serve.adapters import MAX_VERSIONS

        if len(bindings) > MAX_VERSIONS // 2:  # the server follows at most that many (two versions each)
            raise LadleError(
                f"{self.model}: {len(bound)} adapters are bound to this base's pods already, the most one server "
                f"follows ({MAX_VERSIONS // 2}); serve {name} on another base's pods, or unbind one."
            )
        versions = {
            adapter: {alias: v.version for alias, v in promote.aliased(uri, registered).items()}
            for adapter, registered in sorted(bindings.items())
        }
        if previous is not None and bound == bindings and before == versions:
            action = "unchanged"
        else:
            failed = self.roll_out(self.render_adapters(bindings, versions), previous, "base")
            if failed is not None:
                reason, said, undone = failed
                raise SwapFailed(
                    f"{name} v{champion.version} did not become ready on {self.model}'s pods in "
                    f"{self.opts.rollout_timeout_s:g} s ({reason}; kubectl: {said[-300:]}), so it takes no traffic: "
                    f"{undone}, and the pods before it keep serving. Fix what the pods report (their /ready names a "
                    "version they could not load), or raise serve.kubernetes.rollout_timeout_s."
                )
            was = (before.get(name) or {}).get("champion")
            action = "started" if previous is None else "bound" if name not in bound else "swapped"
            if action == "swapped" and was == champion.version:
                action = "unchanged"  # its champion is the same: another alias moved, and the pods rolled for it
        held = {}
        for adapter, aliases in versions.items():
            by_version: dict[str, list[str]] = {}
            for alias, number in sorted(aliases.items()):
                by_version.setdefault(number, []).append(alias)
            held[adapter] = by_version
        return {
            "model": name,
            "version": champion.version,
            "previous_version": (before.get(name) or {}).get("champion"),
            "action": action,
            "base": self.model,
            "front_url": self.url(),
            "server_url": self.url(),
            "server_pid": 0,
            "adapters": [{"name": a, "versions": held[a]} for a in sorted(held)],
            "rolled_out": versions != before or bound != bindings or previous is None,
            "seconds": round(time.monotonic() - started, 3),
            "canary": None,
        }

    @staticmethod
    def pods_state(previous: dict[str, Any] | None) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
        """What the pods of ``previous`` were rolled out with: their bindings (adapter -> registered model, from the
        server's arguments) and the versions the aliases named then (``SERVED_ENV``)."""
        spec = (previous or {}).get("spec") or {}
        pod = (spec.get("template") or {}).get("spec") or spec.get("predictor") or {}
        bindings: dict[str, str] = {}
        versions: dict[str, dict[str, str]] = {}
        for container in pod.get("containers") or []:
            args = container.get("args") or []
            for flag, item in zip(args, args[1:], strict=False):
                adapter, _, target = item.partition("=")
                if flag == "--adapter" and target.startswith("models:/"):
                    bindings[adapter] = target.removeprefix("models:/")
            for env in container.get("env") or []:
                if env.get("name") == SERVED_ENV:
                    versions = json.loads(env.get("value") or "{}")
        return bindings, versions
