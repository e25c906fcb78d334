"""The champion on Kubernetes (``serve.target: kubernetes``): the Deployment and Service, or KServe's
InferenceService, are valid against Kubernetes 1.33's schemas (strict) and KServe v0.20's CRD schema; the pod's
command is ladle's server, which copies the version from the artifact store and answers the probes the objects
name; a promotion applies the new version and waits for its rollout, a rollout that cannot finish is undone
with the pods' reason. No cluster is reachable here: kubectl is the recorded stand-in of tests/compute."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jsonschema
import kubernetes_validate
import pytest
import yaml

from ladle.config import ServeConfig, build_config
from ladle.errors import LadleError
from ladle.fleet import champion
from ladle.fleet.kubernetes import VERSION_ANNOTATION, KubernetesServing
from ladle.lifecycle import promote
from ladle.platform import storage
from ladle.platform.processes import free_port, stop_process
from tests.helpers import fresh_registry, strict_crd_schema
from tests.kubernetes import fake_kubectl

ROOT = Path(__file__).resolve().parents[2]
K8S_VERSION = "1.33.0"
KSERVE = strict_crd_schema(ROOT / "infra" / "k8s" / "schemas" / "serving.kserve.io_v1beta1_inferenceservice.json")
RECORDED = ROOT / "tests" / "kubernetes" / "k8s_recorded"
NAME = "serve-demo"


def version(number: str = "3", source: str = "s3://ladle/models/demo/v3", sha: str = "ab" * 32) -> promote.Version:
    return promote.Version(name=NAME, version=number, source=source, tags={"ladle.model_sha256": sha})


def serve_cfg(**kubernetes) -> ServeConfig:
    return ServeConfig(target="kubernetes", backend="mii", tensor_parallel=2, drain_timeout_s=20, kubernetes=kubernetes)


def validate_core(objects: list[dict]) -> None:
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def validate_inferenceservice(isvc: dict) -> None:
    """KServe's CRD schema, then the predictor's pod part as a core PodTemplate (strict)."""
    jsonschema.validate(isvc, KSERVE)
    predictor = isvc["spec"]["predictor"]
    pod = {k: v for k, v in predictor.items() if k not in ("minReplicas", "maxReplicas", "deploymentStrategy")}
    template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": {"spec": pod}}
    kubernetes_validate.validate(template, K8S_VERSION, strict=True)


def test_the_deployment_and_service_are_valid_and_roll_without_losing_a_pod():
    deployment, service, policy = KubernetesServing(NAME, serve_cfg(replicas=2)).render(version())
    validate_core([deployment, service, policy])
    # Who may call it, by default: the namespace's pods only, and every object says so.
    assert (
        policy["kind"] == "NetworkPolicy"
        and policy["spec"]["podSelector"]["matchLabels"] == (deployment["spec"]["selector"]["matchLabels"])
    )
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {}}], "ports": [{"port": 8000, "protocol": "TCP"}]}]
    assert deployment["metadata"]["annotations"]["ladle.dev/access"].startswith("pods of this namespace only")
    spec = deployment["spec"]
    assert spec["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
    assert deployment["metadata"]["annotations"][VERSION_ANNOTATION] == "3"
    pod = spec["template"]
    assert pod["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"
    (container,) = pod["spec"]["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["startupProbe"]["failureThreshold"] * container["startupProbe"]["periodSeconds"] >= 1800
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"  # the mii backend's tensor_parallel
    assert container["args"][:2] == ["--model", "s3://ladle/models/demo/v3"]
    assert pod["spec"]["terminationGracePeriodSeconds"] > 20 + 5  # drain + the preStop pause
    assert service["spec"]["selector"] == spec["selector"]["matchLabels"]

    broken = copy.deepcopy(deployment)
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pathh"] = "/ready"
    with pytest.raises(kubernetes_validate.ValidationError, match="pathh"):
        validate_core([broken])


def test_the_inferenceservice_is_valid_against_kserves_schema():
    isvc, policy = KubernetesServing(NAME, serve_cfg(kind="inferenceservice")).render(version())
    validate_inferenceservice(isvc)
    validate_core([policy])
    assert policy["spec"]["podSelector"]["matchLabels"] == {"serving.kserve.io/inferenceservice": "ladle-serve-demo"}
    assert isvc["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "RawDeployment"
    predictor = isvc["spec"]["predictor"]
    assert predictor["containers"][0]["name"] == "kserve-container"
    assert predictor["deploymentStrategy"]["rollingUpdate"]["maxUnavailable"] == 0

    broken = copy.deepcopy(isvc)
    broken["spec"]["predictor"]["minReplicas"] = "two"
    with pytest.raises(jsonschema.ValidationError, match="'two' is not of type 'integer'"):
        validate_inferenceservice(broken)
    unknown = copy.deepcopy(isvc)
    unknown["spec"]["predictor"]["minReplica"] = 1
    with pytest.raises(jsonschema.ValidationError, match="'minReplica' was unexpected"):
        validate_inferenceservice(unknown)
    typo = copy.deepcopy(isvc)
    typo["spec"]["predictor"]["containers"][0]["imagee"] = "x"
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError), match="imagee"):
        validate_inferenceservice(typo)


def test_the_pods_command_serves_the_version_from_the_store_and_answers_its_probes(tmp_path, tiny_model, s3_server):
    """The rendered container's command and args, run here (on 127.0.0.1 and a free port instead of the pod's
    0.0.0.0:8000): ladle's server copies the version from S3, answers the readiness, liveness and metrics paths
    the objects name, and drains on SIGTERM with exit 0."""
    os.environ.update(s3_server)
    source = "s3://ladle/models/serve-demo/v3"
    storage.upload_dir(str(tiny_model), source)
    cfg = ServeConfig(target="kubernetes", max_new_tokens=4, drain_timeout_s=10)
    # the weights' digest as merge records it: the server checks the copy it downloads against it
    deployment, *_ = KubernetesServing(NAME, cfg).render(version(source=source, sha=storage.weights_hash(tiny_model)))
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args, port = list(container["args"]), free_port()
    args[args.index("--host") + 1] = "127.0.0.1"
    args[args.index("--port") + 1] = str(port)
    assert container["command"] == ["python", "-m", "ladle.serve"]
    home = tmp_path / "home"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ladle.serve", *args],
        env={**os.environ, "LADLE_HOME": str(home), "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + container["readinessProbe"]["httpGet"]["path"], timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the server did not become ready in 120 s"
            time.sleep(0.5)
        assert httpx.get(url + container["livenessProbe"]["httpGet"]["path"], timeout=5).status_code == 200
        scrape = deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/path"]
        assert "ladle_requests" in httpx.get(url + scrape, timeout=5).text
        answer = httpx.post(
            url + "/v1/chat/completions",
            json={"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
            timeout=60,
        )
        assert answer.status_code == 200 and answer.json()["model"] == NAME
        assert (
            home / "served" / storage.weights_hash(tiny_model)[:16] / "config.json"
        ).exists()  # the copy, keyed by the hash
        proc.terminate()
        assert proc.wait(timeout=60) == 0  # a drained stop, not a crash
    finally:
        stop_process(proc, grace_s=5, group=True)


def play(tmp_path, monkeypatch, name: str, **changes) -> Path:
    played = {**json.loads((RECORDED / f"{name}.json").read_text())}
    played["serving"] = {**played["serving"], **changes}
    home = fake_kubectl.install(tmp_path, played)
    monkeypatch.setenv("FAKE_KUBECTL", str(home))
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    return home


def calls_of(home: Path) -> list[dict]:
    return [json.loads(line) for line in (home / "calls.jsonl").read_text().splitlines()]


def test_a_promotion_applies_the_champion_and_a_rollback_repoints_it(tmp_path, monkeypatch, tiny_model):
    """Real registry (MLflow on SQLite): v1 champion → started; v2 promoted → swapped; rolled back → v1 again,
    each by applying the objects with the champion's version and waiting for the rollout."""
    home = play(tmp_path, monkeypatch, "serving_rollout_done")
    uri = fresh_registry(tmp_path)
    cfg = ServeConfig(target="kubernetes", kubernetes={"namespace": "ml"})
    v1 = promote.register(uri, NAME, "s3://ladle/models/v1", None, {"ladle.model_sha256": "1" * 64})
    promote.promote(uri, NAME, v1.version, "test")
    served = champion.reconcile(uri, NAME, cfg)
    assert (served.action, served.version, served.previous_version) == ("started", "1", None)
    assert served.front_url == "http://ladle-serve-demo.ml.svc.cluster.local:8000" and served.server_pid == 0
    v2 = promote.register(uri, NAME, "s3://ladle/models/v2", None, {"ladle.model_sha256": "2" * 64})
    promote.promote(uri, NAME, v2.version, "test")
    assert champion.reconcile(uri, NAME, cfg).action == "swapped"
    assert champion.reconcile(uri, NAME, cfg).action == "unchanged"
    promote.rollback(uri, NAME)
    back = champion.reconcile(uri, NAME, cfg)
    assert (back.action, back.version, back.previous_version) == ("swapped", "1", "2")
    applied = [c["stdin"] for c in calls_of(home) if c["argv"][0] == "apply"]
    deployments = [next(i for i in a["items"] if i["kind"] == "Deployment") for a in applied]
    assert [d["metadata"]["annotations"][VERSION_ANNOTATION] for d in deployments] == ["1", "2", "2", "1"]
    assert deployments[-1]["spec"]["template"]["spec"]["containers"][0]["args"][1] == "s3://ladle/models/v1"
    waits = [c["argv"] for c in calls_of(home) if c["argv"][0] == "rollout"]
    assert waits and waits[0][:3] == ["rollout", "status", "deployments.apps/ladle-serve-demo"]


def test_a_rollout_that_cannot_finish_is_undone_and_named(tmp_path, monkeypatch):
    """The new version's pods cannot pull their image (recorded): ladle undoes the rollout, the previous version
    keeps serving, and the error names the pods' reason."""
    current = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "ladle-serve-demo", "namespace": "default", "annotations": {VERSION_ANNOTATION: "1"}},
        "spec": {},
    }
    home = play(tmp_path, monkeypatch, "serving_rollout_stuck", current=current)
    monkeypatch.setattr(promote, "champion", lambda uri, name: version("2", "s3://ladle/models/v2"))
    cfg = ServeConfig(target="kubernetes", kubernetes={"image": "ladle:v2", "rollout_timeout_s": 60})
    with pytest.raises(champion.SwapFailed) as caught:
        champion.reconcile("sqlite:///unused.db", NAME, cfg)
    message = str(caught.value)
    assert message.startswith("serve-demo v2 did not become ready on Kubernetes in 60 s (")
    assert 'ImagePullBackOff: Back-off pulling image "ladle:v2"' in message
    assert "exceeded its progress deadline" in message and "v1 keeps serving" in message
    assert ["rollout", "undo", "deployments.apps/ladle-serve-demo", "-n", "default"] in [
        c["argv"] for c in calls_of(home)
    ]
    # The object says v1 again, not the version that failed.
    assert "rolled back to v1 and annotated so" in message
    restored = json.loads((home / "serving" / "Deployment.json").read_text())
    assert restored["metadata"]["annotations"][VERSION_ANNOTATION] == "1"


def test_an_object_ladle_did_not_make_is_neither_replaced_nor_deleted(tmp_path, monkeypatch):
    theirs = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "ladle-serve-demo", "namespace": "default", "annotations": {"owner": "another-team"}},
        "spec": {},
    }
    home = play(tmp_path, monkeypatch, "serving_rollout_stuck", current=theirs)
    monkeypatch.setattr(promote, "champion", lambda uri, name: version("2", "s3://ladle/models/v2"))
    with pytest.raises(LadleError, match=r"Deployment default/ladle-serve-demo exists and was not made by ladle"):
        champion.reconcile("sqlite:///unused.db", NAME, ServeConfig(target="kubernetes"))
    verbs = [c["argv"][0] for c in calls_of(home)]
    assert "apply" not in verbs and "delete" not in verbs


def test_render_serving_prints_valid_objects_for_a_registered_version(tmp_path):
    uri = fresh_registry(tmp_path)
    v1 = promote.register(uri, NAME, "s3://ladle/models/v1", None, {"ladle.model_sha256": "1" * 64})
    promote.promote(uri, NAME, v1.version, "test")
    done = subprocess.run(
        [sys.executable, "-m", "ladle.cli.main", "k8s", "render-serving", NAME, "--tracking-uri", uri,
         "--set", "serve.kubernetes.image=registry.example/ladle:1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    deployment, service, policy = yaml.safe_load_all(done.stdout)
    validate_core([deployment, service, policy])
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.example/ladle:1"
    done = subprocess.run(
        [sys.executable, "-m", "ladle.cli.main", "k8s", "render-serving", NAME, "--tracking-uri", uri,
         "--version", "1", "--kind", "inferenceservice"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    isvc, policy = yaml.safe_load_all(done.stdout)
    validate_inferenceservice(isvc)
    validate_core([policy])
    done = subprocess.run(
        [sys.executable, "-m", "ladle.cli.main", "k8s", "render-serving", "never-trained", "--tracking-uri", uri],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "MODEL = 'never-trained': it has no `champion` to serve" in done.stderr


def test_a_canary_with_kubernetes_serving_is_refused_at_load():
    with pytest.raises(LadleError, match="promote.canary is set but serve.target = 'kubernetes'"):
        build_config(
            {
                "base": "ladle://tiny-llama",
                "data": {"path": "x"},
                "serve": {"target": "kubernetes"},
                "promote": {"canary": {}},
            },
            [],
        )


def test_access_by_api_key_needs_the_key_and_renders_no_policy():
    with pytest.raises(ValueError, match=r"serve.kubernetes.access = 'api_key': serve.api_key_env not set"):
        ServeConfig(target="kubernetes", kubernetes={"access": "api_key"})
    cfg = ServeConfig(target="kubernetes", api_key_env="LADLE_API_KEY", kubernetes={"access": "api_key"})
    objects = KubernetesServing(NAME, cfg).render(version())
    assert [o["kind"] for o in objects] == ["Deployment", "Service"]
    container = objects[0]["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][container["args"].index("--api-key-env") + 1] == "LADLE_API_KEY"
    assert container["envFrom"] == [{"secretRef": {"name": "ladle-env"}}]
    open_cfg = ServeConfig(target="kubernetes", kubernetes={"access": "open"})
    (deployment, _) = KubernetesServing(NAME, open_cfg).render(version())
    assert deployment["metadata"]["annotations"]["ladle.dev/access"].startswith("anyone who reaches the pods")


def test_a_version_on_this_machines_disk_is_refused_naming_output(tmp_path):
    local = version("3", str(tmp_path / "runs" / "merged"))
    with pytest.raises(LadleError, match=r"output: v3 of serve-demo is at .*a path on this machine, which no pod"):
        KubernetesServing(NAME, ServeConfig(target="kubernetes")).render(local)


def test_render_serving_reads_the_store_of_the_config_as_set(tmp_path):
    """`--config C --set output=X`: the champion is looked up in X's store, as `ladle run` would have kept it."""
    out = tmp_path / "elsewhere"
    out.mkdir()
    uri = fresh_registry(out)
    v1 = promote.register(uri, NAME, "s3://ladle/models/v1", None, {"ladle.model_sha256": "1" * 64})
    promote.promote(uri, NAME, v1.version, "test")
    done = subprocess.run(
        [sys.executable, "-m", "ladle.cli.main", "k8s", "render-serving", NAME, "--config", "recipes/tiny-cpu.yaml",
         "--set", f"output={out}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    deployment = next(yaml.safe_load_all(done.stdout))
    assert deployment["spec"]["template"]["spec"]["containers"][0]["args"][1] == "s3://ladle/models/v1"


# -- adapters on Kubernetes (promote.merge: false) --------------------------------------------------------------


PODS_URI = "http://mlflow.ml.svc:5000"


def adapter_cfg(tiny_model, **kubernetes):
    sets = ["promote.merge=false", "serve.target=kubernetes", f"serve.kubernetes.tracking_uri={PODS_URI}"]
    sets += [f"serve.kubernetes.{k}={v}" for k, v in kubernetes.items()]
    return build_config({"base": "s3://ladle/bases/tiny", "data": {"path": "ladle://demo-alpaca"}}, sets)


def test_a_bases_pods_serve_its_adapters_from_the_registrys_aliases_and_are_valid():
    """The base's objects: one Deployment per base, its server bound to each adapter's registered model and
    reading the aliases from the registry the pods reach (no periodic sync: versions change by rollouts), the
    versions of that rollout in the pod's environment; strict against Kubernetes' schema, and the server's own
    argument parser takes the arguments."""
    from ladle.fleet.kubernetes import SERVED_ENV, KubernetesAdapters
    from ladle.serve import __main__ as server

    base = promote.Version(name="base", version="base", source="s3://ladle/bases/tiny", tags={})
    pods = KubernetesAdapters("base-0123456789ab", ServeConfig(target="kubernetes"), base, PODS_URI)
    versions = {"bot": {"champion": "2", "challenger": "3"}, "ops": {"champion": "1"}}
    deployment, service, policy = pods.render_adapters({"bot": "bot", "ops": "ops-model"}, versions)
    validate_core([deployment, service, policy])
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert (
        args[:2] == ["--model", "s3://ladle/bases/tiny"] and deployment["metadata"]["name"] == "ladle-base-0123456789ab"
    )
    assert "bot=models:/bot" in args and "ops=models:/ops-model" in args
    assert args[-4:] == ["--tracking-uri", PODS_URI, "--adapter-sync-s", "0"]
    assert json.loads(container["env"][0]["value"]) == versions and container["env"][0]["name"] == SERVED_ENV
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"  # names a version a pod could not load
    assert pods.pods_state(deployment) == ({"bot": "bot", "ops": "ops-model"}, versions)
    parsed = server.parser().parse_args(args)
    assert parsed.adapter == ["bot=models:/bot", "ops=models:/ops-model"] and parsed.adapter_sync_s == 0
    isvc, _ = KubernetesAdapters(
        "base-0123456789ab", ServeConfig(target="kubernetes", kubernetes={"kind": "inferenceservice"}), base, PODS_URI
    ).render_adapters({"bot": "bot"}, {"bot": {"champion": "2"}})
    validate_inferenceservice(isvc)

    with pytest.raises(LadleError, match=r"serve.kubernetes.tracking_uri = 'sqlite:///m.db': the pods read"):
        KubernetesAdapters("base-0123456789ab", ServeConfig(target="kubernetes"), base, "sqlite:///m.db")


def test_adapters_are_bound_promoted_and_rolled_back_on_their_bases_pods(tmp_path, monkeypatch, tiny_model):
    """Real registry (MLflow on SQLite), recorded kubectl: the first adapter starts its base's Deployment, a second
    is bound beside it, a promotion rolls the pods with the new versions, nothing changed applies nothing, and a
    rollout that cannot finish is undone, naming the pods' reason. A base on this machine, or an adapter on this
    machine's disk, is refused naming the field."""
    from ladle.fleet import adapters
    from ladle.lifecycle.lineage import base_signature

    home = play(tmp_path, monkeypatch, "serving_rollout_done")
    uri = fresh_registry(tmp_path)
    signature = base_signature(tiny_model)
    tags = {"ladle.kind": "adapter", "ladle.base_signature": signature, "ladle.model_sha256": "1" * 64}
    for name in ("bot", "ops"):
        promote.register(uri, name, f"s3://ladle/models/{name}/v1/adapter", None, tags)
        promote.promote(uri, name, "1", "test")
    cfg = adapter_cfg(tiny_model, namespace="ml")

    def serve(name: str) -> dict:
        return adapters.serve_registered(uri, name, cfg, lambda: tiny_model)[0]

    first = serve("bot")
    assert (first["action"], first["base"], first["server_pid"]) == ("started", adapters.front_name(signature), 0)
    assert first["front_url"] == f"http://ladle-{first['base']}.ml.svc.cluster.local:8000"
    assert serve("ops")["action"] == "bound"
    promote.register(uri, "bot", "s3://ladle/models/bot/v2/adapter", None, {**tags, "ladle.model_sha256": "2" * 64})
    promote.promote(uri, "bot", "2", "better")
    swapped = serve("bot")
    assert (swapped["action"], swapped["version"], swapped["previous_version"]) == ("swapped", "2", "1")
    assert {a["name"]: a["versions"] for a in swapped["adapters"]} == {
        "bot": {"2": ["challenger", "champion"]},
        "ops": {"1": ["challenger", "champion"]},
    }
    applies = [c for c in calls_of(home) if c["argv"][0] == "apply"]
    unchanged = serve("ops")
    assert unchanged["action"] == "unchanged" and unchanged["rolled_out"] is False
    assert [c for c in calls_of(home) if c["argv"][0] == "apply"] == applies  # nothing changed, nothing applied
    last = next(i for i in applies[-1]["stdin"]["items"] if i["kind"] == "Deployment")
    args = last["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "bot=models:/bot" in args and "ops=models:/ops" in args

    scenario = json.loads((RECORDED / "serving_rollout_stuck.json").read_text())
    (home / "scenario.json").write_text(json.dumps(scenario))
    promote.rollback(uri, "bot", "1")
    with pytest.raises(champion.SwapFailed) as caught:
        serve("bot")
    message = str(caught.value)
    assert message.startswith(f"bot v1 did not become ready on {first['base']}'s pods in 900 s (")
    assert (
        'ImagePullBackOff: Back-off pulling image "ladle:' in message and "the pods before it keep serving" in message
    )
    assert ["rollout", "undo", f"deployments.apps/ladle-{first['base']}", "-n", "ml"] in [
        c["argv"] for c in calls_of(home)
    ]

    import ladle.serve.adapters

    cap = ladle.serve.adapters.MAX_VERSIONS
    monkeypatch.setattr(ladle.serve.adapters, "MAX_VERSIONS", 4)  # this server follows two adapters at most
    promote.register(uri, "third", "s3://ladle/models/third/v1/adapter", None, tags)
    promote.promote(uri, "third", "1", "test")
    with pytest.raises(LadleError, match="2 adapters are bound to this base's pods already, the most one server"):
        serve("third")
    monkeypatch.setattr(ladle.serve.adapters, "MAX_VERSIONS", cap)
    local = adapter_cfg(tiny_model).model_copy(update={"base": str(tiny_model)})
    with pytest.raises(LadleError, match="the pods load the base from the artifact store"):
        adapters.serve_registered(uri, "ops", local, lambda: tiny_model)
    promote.register(uri, "ops", str(tmp_path), None, tags)
    promote.promote(uri, "ops", "2", "a folder here")
    with pytest.raises(LadleError, match="a path on this machine, which no pod can read"):
        serve("ops")
