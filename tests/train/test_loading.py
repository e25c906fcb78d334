"""The checkpoint reader behind sharded loading and the streaming merge: every read equals safetensors' own,
and a read straight into its destination adds nothing beside it (no mapped pages, no second copy)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ladle.train.loading import Checkpoint, leading_rows, region_shape

TENSORS = {
    "embed.weight": torch.randn(37, 8),
    "norm.weight": torch.randn(8).to(torch.bfloat16),
    "proj.weight": torch.randn(5, 6).to(torch.float16),
    "conv.weight": torch.randn(7, 3, 2),
    "steps": torch.tensor(11, dtype=torch.int64),
    "mask": torch.tensor([True, False, True]),
}
REGIONS = [
    None,
    (slice(0, 19),),
    (slice(19, 37), slice(None)),
    (slice(36, 37), slice(0, 8)),
    (slice(5, 5), slice(None)),  # an empty shard (torch.chunk's last ones can be)
    (slice(3, 9), slice(2, 6)),  # a column slice: not contiguous in the file
    (slice(0, 37, 2),),  # a stride: not contiguous either
]


@pytest.fixture
def folder(tmp_path):
    """Two safetensors files and their index, as save_pretrained writes a sharded model."""
    names = sorted(TENSORS)
    files = {"model-00001-of-00002.safetensors": names[:3], "model-00002-of-00002.safetensors": names[3:]}
    for file, held in files.items():
        save_file({n: TENSORS[n] for n in held}, tmp_path / file, metadata={"format": "pt"})
    weight_map = {n: file for file, held in files.items() for n in held}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tmp_path


def safetensors_read(folder, name, region):
    file = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][name]
    with safe_open(folder / file, framework="pt") as f:
        return (f.get_tensor(name) if region is None else f.get_slice(name)[region]).clone()


CASES = [
    (name, region)
    for name, tensor in sorted(TENSORS.items())
    for region in REGIONS
    if region is None or 0 < len(region) <= tensor.dim()  # a region slices at most the tensor's dimensions
]


@pytest.mark.parametrize(("name", "region"), CASES)
def test_every_read_equals_safetensors_own(folder, name, region):
    tensor = TENSORS[name]
    ckpt = Checkpoint(folder)
    expected = safetensors_read(folder, name, region)
    got = ckpt.read(name, region)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert torch.equal(got, expected)
    # Into a destination of another dtype (the run's): converted, as copy_ converts.
    if tensor.is_floating_point():
        out = torch.full(expected.shape, float("nan"), dtype=torch.float64)
        assert ckpt.read_into(name, out, region) is out
        assert torch.equal(out, expected.to(torch.float64))


def test_rows_are_read_directly_and_columns_through_safetensors():
    assert leading_rows((37, 8), None) == (0, 37)
    assert leading_rows((37, 8), (slice(19, 37), slice(None))) == (19, 18)
    assert leading_rows((37, 8), (slice(3, 9), slice(2, 6))) is None
    assert leading_rows((37, 8), (slice(0, 37, 2),)) is None
    assert leading_rows((), None) == (0, 1)
    assert region_shape((37, 8), (slice(36, 40),)) == (1, 8)
    assert region_shape((7, 3, 2), (slice(1, 3), slice(None))) == (2, 3, 2)


def test_a_cut_short_file_is_an_error_not_a_half_read_tensor(tmp_path):
    save_file({"w": torch.randn(64, 64)}, tmp_path / "model.safetensors")
    ckpt = Checkpoint(tmp_path)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(RuntimeError, match=r"ends inside tensor w; the file is cut short"):
        ckpt.read("w")


def test_a_file_that_is_not_safetensors_is_named(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(ValueError, match=r"model.safetensors is not a readable safetensors file .* re-save the model"):
        Checkpoint(tmp_path)


PEAK_SCRIPT = """
import json, resource, sys
import torch
from ladle.train.loading import Checkpoint

ckpt = Checkpoint(sys.argv[1])
out = torch.zeros(8192, 2048)  # the rows this rank holds, allocated and touched before the read
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
ckpt.read_into("embed.weight", out, (slice(8192, 16384), slice(None)))
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with open(sys.argv[2], "w") as f:
    json.dump({"added_mib": (after - before) / 1024, "sum": float(out.double().sum())}, f)
"""


def test_reading_rows_adds_nothing_beside_their_destination(tmp_path):
    """Half of a 128 MiB embedding read into its 64 MiB destination: the peak grows by less than a tenth of
    that. Through safetensors' mapped view and a clone, as before, it grew by 131 MiB."""
    embed = torch.randn(16384, 2048)
    save_file({"embed.weight": embed}, tmp_path / "model.safetensors")
    report = tmp_path / "peak.json"
    subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(tmp_path), str(report)], check=True)
    measured = json.loads(report.read_text())
    assert measured["sum"] == pytest.approx(float(embed[8192:].double().sum()))
    assert measured["added_mib"] < 6.4, measured


def test_reads_into_a_parameter_that_requires_grad(folder):
    """A rank's parameter is read in place, outside no_grad too; autograd records nothing."""
    param = torch.nn.Parameter(torch.zeros(18, 8))
    Checkpoint(folder).read_into("embed.weight", param, (slice(19, 37), slice(None)))
    assert torch.equal(param.detach(), TENSORS["embed.weight"][19:])
    assert param.requires_grad and param.grad_fn is None
