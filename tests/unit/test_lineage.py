"""The retraining fingerprint: the same inputs give the same one; new data, a new base with the same tokenizer,
or a changed learning rate give another; settings that only change how a run proceeds do not."""

from __future__ import annotations

import shutil

from ladle.assets import resolve_base
from ladle.config import build_config
from ladle.lineage import run_fingerprint

MINIMAL = {"base": "ladle://tiny-llama", "data": {"path": "ladle://demo-alpaca"}}


def test_what_changes_the_trained_model_changes_the_fingerprint(tmp_path):
    base = resolve_base("ladle://tiny-llama")
    cfg = build_config(MINIMAL, [])
    same = run_fingerprint(cfg, "data-1", base)
    assert run_fingerprint(build_config(MINIMAL, []), "data-1", base) == same
    assert run_fingerprint(cfg, "data-2", base) != same
    assert run_fingerprint(build_config(MINIMAL, ["training.lr=1e-3"]), "data-1", base) != same
    assert run_fingerprint(build_config(MINIMAL, ["training.lora.r=4"]), "data-1", base) != same
    for how in ("training.checkpoint_every=7", "training.eval_every=3", "training.save_shard_mib=64"):
        assert run_fingerprint(build_config(MINIMAL, [how]), "data-1", base) == same, how

    other = tmp_path / "base"  # the same tokenizer and config, other weights
    shutil.copytree(base, other)
    weights = next(other.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert run_fingerprint(cfg, "data-1", other) != same
