"""The worker image (infra/Dockerfile) cannot be built here (no Docker engine), so what can drift is checked:
it builds on a public base pinned to a tag, sets up with the Makefile's own `setup` target (the one the test
command runs) and only with extras pyproject declares, on the Python the Makefile uses, and its kubectl is the
Kubernetes minor the rendered objects are validated against."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "infra" / "Dockerfile").read_text()
MAKEFILE = (ROOT / "Makefile").read_text()


def test_the_base_is_a_public_image_pinned_to_a_tag():
    (base,) = re.findall(r"^FROM\s+(\S+)", DOCKERFILE, re.M)
    image, _, tag = base.partition(":")
    assert image == "nvidia/cuda" and re.fullmatch(r"\d+\.\d+\.\d+-cudnn-devel-ubuntu\d+\.\d+", tag), base


def test_the_image_runs_the_makefiles_setup_with_declared_extras_and_its_python():
    (setup,) = re.findall(r"RUN make setup (.*)", DOCKERFILE)
    given = dict(re.findall(r'(\w+)=("[^"]*"|\S+)', setup))
    declared = {m.group(1) for m in re.finditer(r"^(\w+) \?=", MAKEFILE, re.M)}
    assert set(given) <= declared, set(given) - declared  # every variable it sets is one `make setup` reads
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(given["EXTRAS"].split(",")) <= set(extras)
    assert given["PYTHON"] in DOCKERFILE.split("apt-get install", 1)[1]  # the interpreter it installs
    assert re.search(r"^setup:", MAKEFILE, re.M) and "make test" in (ROOT / ".ci" / "run").read_text()


def test_kubectl_is_the_kubernetes_version_objects_are_validated_against():
    from tests.compute.test_kubernetes import VERSION

    (minor,) = re.findall(r"ARG KUBECTL_MINOR=v(\d+\.\d+)", DOCKERFILE)
    assert VERSION.startswith(minor + ".")
