"""The training modules' launches start from a pre-imported fork server (``tests/warm_launch.py``), except in the
modules that test the launcher's own start, its signals, what a rank imports and what a rank's memory holds from
its start on (the memory-truth module measures resident pages, which a fork server's inherited heap changes):
those start it for real."""

from __future__ import annotations

import pytest

REAL_START = {"test_launch", "test_launch_env", "test_memory_truth", "test_multinode", "test_rank_imports"}


@pytest.fixture(scope="module", autouse=True)
def warm_launches(request):
    if request.module.__name__.rsplit(".", 1)[-1] in REAL_START:
        yield
        return
    from ladle.train import run
    from tests.warm_launch import start_warm

    real = run.start_launcher
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(run, "start_launcher", lambda argv, spec: start_warm(argv, spec, real))
        yield


@pytest.fixture
def fast_paths(request):
    """``plain``: the model's own head over padded pair rows; ``fused+joined``: the chunked fused head (a few
    tokens per chunk) over the micro-batch joined into one row of real tokens."""
    from ladle.train import run_state
    from ladle.train.kernels import FusedHead
    from ladle.train.padding_free import JoinRows

    def install(model):
        if request.param == "fused+joined":
            state = run_state.on(model)
            state.fused = FusedHead.install(model.get_output_embeddings(), "chunked", 5)
            state.joiner = JoinRows.for_config(model.config, by_example=True)

    return request.param, install
