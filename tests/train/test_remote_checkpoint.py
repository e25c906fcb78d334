"""Checkpoints in a remote store: DCP read in place (each rank opens only the files holding its regions), and the
local folder DeepSpeed reads."""

from __future__ import annotations

import os

import pytest

from tests.helpers import run_ranks


def save_then_load(rank: int, world: int, port: int, queue, url: str, env: dict) -> None:
    import tempfile

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import _fsspec_filesystem
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from ladle.platform import storage
    from ladle.train.runtime.base import dcp_reader

    os.environ.update(env)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16)
    with tempfile.TemporaryDirectory() as tmp:  # as ladle saves: each rank writes locally, then uploads its files
        dcp.save({"w": distribute_tensor(full, mesh, [Shard(0)])}, checkpoint_id=tmp)
        dist.barrier()
        storage.upload_dir(tmp, url, complete=False)
    dist.barrier()

    opened: list[str] = []
    create_stream = _fsspec_filesystem.FileSystem.create_stream

    def recording(self, path, mode):
        opened.append(os.path.basename(os.fspath(path)))
        return create_stream(self, path, mode)

    _fsspec_filesystem.FileSystem.create_stream = recording
    sharded = {"w": distribute_tensor(torch.zeros(64, 16), mesh, [Shard(0)])}
    dcp.load(sharded, storage_reader=dcp_reader(url))
    mine = sorted(opened)
    opened.clear()
    whole = {"w": distribute_tensor(torch.zeros(64, 16), mesh, [Replicate()])}
    dcp.load(whole, storage_reader=dcp_reader(url))
    queue.put(
        {
            "rank": rank,
            "sharded_opened": mine,
            "sharded_equal": torch.equal(sharded["w"].to_local(), full.chunk(world)[rank]),
            "whole_opened": sorted(opened),
            "whole_equal": torch.equal(whole["w"].to_local(), full),
        }
    )
    dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_each_rank_reads_only_its_own_shard_file_from_s3(s3_server):
    got = sorted(run_ranks(save_then_load, 2, "s3://ladle/dcp-reader", s3_server), key=lambda r: r["rank"])
    for r in got:
        assert r["sharded_equal"] and r["whole_equal"]
        # the metadata, then this rank's data file only
        assert r["sharded_opened"] == sorted([".metadata", f"__{r['rank']}_0.distcp"]), r
        assert r["whole_opened"] == [".metadata", "__0_0.distcp", "__1_0.distcp"], r  # a replica needs both


def test_local_dir_is_the_folder_itself_or_a_download_removed_after(s3_server, monkeypatch, tmp_path):
    """The folder DeepSpeed's loader reads: in place when local; from S3, a temporary download of its files."""
    from ladle.platform import storage

    for key, value in s3_server.items():
        monkeypatch.setenv(key, value)
    source = tmp_path / "ckpt"
    for name in ("a/zero_pp_rank_0.pt", "a/zero_pp_rank_1.pt", "state.pt"):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_text(name)
    with storage.local_dir(str(source)) as here:
        assert here == source
    storage.upload_dir(source, "s3://ladle/local-dir")
    with storage.local_dir("s3://ladle/local-dir") as folder:
        got = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
        assert got == ["a/zero_pp_rank_0.pt", "a/zero_pp_rank_1.pt", "state.pt"]  # not the marker
        assert (folder / "state.pt").read_text() == "state.pt"
    assert not folder.exists()


def test_a_served_copy_from_s3_is_checked_against_its_recorded_digest(s3_server, monkeypatch, tmp_path):
    """``ladle.model_sha256`` names the weights ladle wrote: a store object changed or cut short after that is
    refused with both digests named and nothing cached; the intact folder is served, and checked once."""
    from ladle.fleet.deploy import local_model_dir
    from ladle.lifecycle.merge import MergedModel
    from ladle.platform import storage

    for key, value in s3_server.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("LADLE_HOME", str(tmp_path / "home"))
    source = tmp_path / "merged"
    source.mkdir()
    (source / "config.json").write_text("{}")
    (source / "model.safetensors").write_bytes(b"weights" * 1000)
    digest = storage.weights_hash(source)
    storage.upload_dir(source, "s3://ladle/served-check")
    fs, root = storage.filesystem("s3://ladle/served-check")
    fs.pipe_file(f"{root}/model.safetensors", b"weights" * 999)  # half-written, or replaced
    merged = MergedModel(url="s3://ladle/served-check", sha256=digest, parameters=0)
    with pytest.raises(ValueError, match=r"its weights' SHA-256 is [0-9a-f]{16}\.\.\., not the [0-9a-f]{16}\.\.\. "):
        local_model_dir(merged)
    served = tmp_path / "home" / "served"
    assert not served.exists() or list(served.iterdir()) == []  # nothing cached, no temporary left
    fs.pipe_file(f"{root}/model.safetensors", b"weights" * 1000)
    folder = local_model_dir(merged)
    assert storage.weights_hash(folder) == digest and folder.parent == served
