import os

from pydantic import SecretStr

from ladle.blocks import ArtifactStore, ComputeTarget, MlflowServer
from ladle.config import build_config
from ladle.flows.recipe import apply_blocks


def test_named_blocks_overlay_the_config(prefect_harness, tmp_path, monkeypatch):
    for key in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(key, raising=False)  # restored (to absent) after the test
    ArtifactStore(
        url="s3://team-bucket/ladle",
        endpoint_url="http://127.0.0.1:9",
        access_key_id=SecretStr("AK"),
        secret_access_key=SecretStr("SK"),
    ).save("team-store", overwrite=True)
    MlflowServer(tracking_uri=f"sqlite:///{tmp_path}/m.db").save("team-mlflow", overwrite=True)
    ComputeTarget(
        target="slurm", gpus=4, cpu_processes=3, nodes=2, slurm={"partition": "h100", "time_limit": "08:00:00"}
    ).save("team-compute", overwrite=True)
    cfg = build_config({"base": "ladle://tiny-llama", "data": {"path": "ladle://demo-alpaca"}}, [])

    applied = apply_blocks(cfg, "team-store", "team-mlflow", "team-compute")

    assert applied.output == "s3://team-bucket/ladle"
    assert applied.tracking.uri == f"sqlite:///{tmp_path}/m.db"
    assert (applied.parallelism.gpus, applied.parallelism.cpu_processes, applied.parallelism.nodes) == (4, 3, 2)
    assert applied.compute.target == "slurm"
    assert (applied.compute.slurm.partition, applied.compute.slurm.time_limit) == ("h100", "08:00:00")
    assert os.environ["AWS_ACCESS_KEY_ID"] == "AK" and os.environ["AWS_ENDPOINT_URL"] == "http://127.0.0.1:9"


def test_no_blocks_leaves_the_config_alone():
    cfg = build_config({"base": "ladle://tiny-llama", "data": {"path": "ladle://demo-alpaca"}}, [])
    assert apply_blocks(cfg, None, None, None) == cfg
