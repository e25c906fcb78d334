import json

from prefect import flow

from ladle.config import build_config
from ladle.plan.inputs import resolve_inputs
from ladle.tasks.prepare import prepare_cached


@flow
def prepare_twice(first, second):
    a = prepare_cached(first.data, resolve_inputs(first), return_state=True)
    b = prepare_cached(second.data, resolve_inputs(second), return_state=True)
    return a.name, b.name, a.result().fingerprint, b.result().fingerprint


def config(data, out, **data_opts):
    return build_config(
        {"base": "ladle://tiny-llama", "data": {"path": str(data), **data_opts}, "output": str(out)}, []
    )


def write(path, n):
    path.write_text(
        "".join(json.dumps({"instruction": f"Add {i} and 2.", "output": str(i + 2)}) + "\n" for i in range(n))
    )


def test_prepare_cache_hit_and_misses(prefect_harness, tiny_model, tmp_path):
    data = tmp_path / "d.jsonl"
    write(data, 40)
    cfg = config(data, tmp_path / "out", seq_len=64)

    first, second, fp1, fp2 = prepare_twice(cfg, cfg)
    assert (first, second) == ("Completed", "Cached")
    assert fp1 == fp2

    _, changed_len, _, fp3 = prepare_twice(cfg, config(data, tmp_path / "out", seq_len=96))
    assert changed_len == "Completed" and fp3 != fp1

    write(data, 41)
    changed_data, again, fp4, _ = prepare_twice(cfg, cfg)
    assert (changed_data, again) == ("Completed", "Cached") and fp4 not in (fp1, fp3)


def test_a_deleted_dataset_is_prepared_again_not_taken_from_the_cache(prefect_harness, tiny_model, tmp_path):
    """`make clean` removes runs/; the cache must not hand back the folder it deleted."""
    import shutil

    from ladle.platform import storage

    data = tmp_path / "d.jsonl"
    write(data, 40)
    cfg = config(data, tmp_path / "out", seq_len=64)
    first, second, _, _ = prepare_twice(cfg, cfg)
    assert (first, second) == ("Completed", "Cached")
    shutil.rmtree(tmp_path / "out")
    again, cached, fp, _ = prepare_twice(cfg, cfg)
    assert (again, cached) == ("Completed", "Cached")
    assert storage.is_complete(str(tmp_path / "out" / "datasets" / fp))
