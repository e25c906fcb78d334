"""A stand-in ``kubectl`` (the cluster this machine lacks) that plays a recorded scenario back.

Put on PATH as ``kubectl`` by ``install``. It answers from ``$FAKE_KUBECTL/scenario.json`` (one of
``k8s_recorded/``): each ``get`` of the job is one step of the scenario (the last repeats), and the pods and
Kueue Workloads it answers are that step's. The job it returns is the one ladle applied, with the step's
``status``. Every call is appended to ``calls.jsonl``; what is applied is kept in ``applied/``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

JOBS = ("trainjobs.trainer.kubeflow.org", "pytorchjobs.kubeflow.org")


def main(argv: list[str]) -> int:
    home = Path(os.environ["FAKE_KUBECTL"])
    scenario = json.loads((home / "scenario.json").read_text())
    stdin = sys.stdin.read() if argv[:1] == ["apply"] else None
    with (home / "calls.jsonl").open("a") as f:
        f.write(json.dumps({"argv": argv, "stdin": json.loads(stdin) if stdin else None}) + "\n")
    if "serving" in scenario:
        return serving(home, scenario["serving"], argv, stdin)
    steps = scenario["steps"]
    counter = home / "step"
    looked = int(counter.read_text()) if counter.exists() else 0
    step = steps[min(max(looked - 1, 0), len(steps) - 1)]
    verb, what = argv[0], argv[1] if len(argv) > 1 else ""
    if verb == "apply":
        obj = json.loads(stdin or "{}")
        refused = scenario.get("refuse", {}).get(obj.get("kind"))
        if refused:
            print(refused, file=sys.stderr)
            return 1
        (home / "applied").mkdir(exist_ok=True)
        (home / "applied" / f"{obj['kind']}.json").write_text(json.dumps(obj))
        print(f"{obj['kind'].lower()}/{obj['metadata']['name']} created")
        return 0
    if verb == "delete":
        return 0
    if verb == "logs":
        pod = argv[2]
        for line in scenario.get("log", ["training on {pod}"]):
            print(line.format(pod=pod), flush=True)
        if scenario.get("log_hangs"):  # a stream whose connection hung: it never ends by itself
            import time

            time.sleep(600)
        return 0
    if verb == "get" and what.startswith("clustertrainingruntimes"):
        if scenario.get("runtime_exists"):
            print(what)
            return 0
        print(f'Error from server (NotFound): clustertrainingruntimes "{what}" not found', file=sys.stderr)
        return 1
    if verb == "get" and what in JOBS:
        kind = "TrainJob" if what.startswith("trainjobs") else "PyTorchJob"
        applied = home / "applied" / f"{kind}.json"
        if not applied.exists():
            print(f'Error from server (NotFound): {what} "{argv[2]}" not found', file=sys.stderr)
            return 1
        counter.write_text(str(looked + 1))
        job = json.loads(applied.read_text())
        job["metadata"]["uid"] = "5e7c1d0a-trainjob"
        job["status"] = steps[min(looked, len(steps) - 1)]["status"]
        print(json.dumps(job))
        return 0
    if verb == "get" and what == "pods":
        print(json.dumps({"apiVersion": "v1", "kind": "List", "items": step.get("pods", [])}))
        return 0
    if verb == "get" and what.startswith("workloads"):
        print(json.dumps({"apiVersion": "v1", "kind": "List", "items": step.get("workloads", [])}))
        return 0
    print(f"fake kubectl: no answer recorded for {argv}", file=sys.stderr)
    return 2


SERVING = {"deployments.apps": "Deployment", "inferenceservices.serving.kserve.io": "InferenceService"}


def serving(home: Path, scenario: dict, argv: list[str], stdin: str | None) -> int:
    """``serve.target: kubernetes``: the serving object is what was applied last (or the scenario's ``current``);
    ``rollout status`` and ``wait`` answer the scenario's ``rollout``."""
    stored = home / "serving"
    stored.mkdir(exist_ok=True)
    verb, what = argv[0], argv[1] if len(argv) > 1 else ""
    if verb == "apply":
        obj = json.loads(stdin or "{}")
        for item in obj.get("items", [obj]):
            (stored / f"{item['kind']}.json").write_text(json.dumps(item))
        return 0
    if verb == "get" and what in SERVING:
        kind = SERVING[what]
        if (stored / f"{kind}.json").exists():
            print((stored / f"{kind}.json").read_text())
            return 0
        if scenario.get("current"):
            print(json.dumps(scenario["current"]))
            return 0
        print(f'Error from server (NotFound): {what} "{argv[2]}" not found', file=sys.stderr)
        return 1
    if verb in ("rollout", "wait") and what != "undo":
        answer = scenario["rollout"]
        print(answer.get("stdout", ""))
        print(answer.get("stderr", ""), file=sys.stderr)
        return answer["rc"]
    if verb == "get" and what == "pods":
        print(json.dumps({"apiVersion": "v1", "kind": "List", "items": scenario.get("pods", [])}))
        return 0
    if verb == "annotate":
        kind = SERVING[what]
        obj = json.loads((stored / f"{kind}.json").read_text())
        key, _, value = argv[-1].partition("=")
        obj["metadata"].setdefault("annotations", {})[key] = value
        (stored / f"{kind}.json").write_text(json.dumps(obj))
        return 0
    if verb in ("rollout", "delete"):
        return 0
    print(f"fake kubectl: no answer recorded for {argv}", file=sys.stderr)
    return 2


def install(tmp: Path, scenario: dict) -> Path:
    """A ``kubectl`` on ``tmp/bin`` playing ``scenario``; returns the folder it records into."""
    home = tmp / "kubectl-home"
    home.mkdir()
    (home / "scenario.json").write_text(json.dumps(scenario))
    binary = tmp / "bin" / "kubectl"
    binary.parent.mkdir()
    binary.write_text(
        f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from fake_kubectl import main\nsys.exit(main(sys.argv[1:]))\n"
    )
    binary.chmod(0o755)
    return home


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
