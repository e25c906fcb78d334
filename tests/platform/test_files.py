"""One way to write a local file whole: concurrent writers never leave a torn file or a temporary one behind,
the mode is the file's from its first byte, and a failed write leaves the old file as it was."""

from __future__ import annotations

import stat
from concurrent.futures import ThreadPoolExecutor

import pytest

from ladle.platform.files import one_builder, write_atomic


def test_concurrent_writers_leave_one_whole_file(tmp_path):
    target = tmp_path / "deep" / "record.json"
    payloads = [str(i) * 200_000 for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda p: write_atomic(target, p), payloads * 4))
    assert target.read_text() in payloads
    assert [p.name for p in target.parent.iterdir()] == ["record.json"]


def test_the_mode_is_set_and_a_failed_write_keeps_the_old_file(tmp_path):
    target = write_atomic(tmp_path / "token.json", '{"token": "x"}', mode=0o600)
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    with pytest.raises(TypeError):
        write_atomic(target, 12345)  # not text or bytes: nothing replaced
    assert target.read_text() == '{"token": "x"}'
    assert [p.name for p in tmp_path.iterdir()] == ["token.json"]


def test_a_folder_is_built_whole_or_not_at_all(tmp_path):
    from ladle.platform.files import building

    target = tmp_path / "model"
    with pytest.raises(RuntimeError), building(target) as tmp:
        (tmp / "config.json").write_text("{}")
        raise RuntimeError("the save failed")
    assert list(tmp_path.iterdir()) == []  # nothing half-built, nothing left
    with building(target) as tmp:
        (tmp / "config.json").write_text('{"first": true}')
    with building(target) as tmp:  # another process's copy, finished second: the first stays
        (tmp / "config.json").write_text('{"second": true}')
    assert (target / "config.json").read_text() == '{"first": true}'
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_one_builder_at_a_time_a_killed_holder_frees_the_lock_and_a_stuck_one_times_out(tmp_path):
    """Another process holding the lock: the wait ends at its deadline with the lock file named; once that
    process is killed (mid-build, say), the kernel has released its lock and the next builder goes in."""
    import subprocess
    import sys

    target = tmp_path / "model"
    hold = (
        "import fcntl, sys, time\n"
        f"h = open({str(tmp_path / '.model.lock')!r}, 'a'); fcntl.flock(h, fcntl.LOCK_EX)\n"
        "print('held', flush=True); time.sleep(120)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with (
            pytest.raises(TimeoutError, match=r"another process held .*\.model\.lock for over 0 s"),
            one_builder(target, deadline_s=0.3),
        ):
            pass
    finally:
        holder.kill()
        holder.wait(30)
    with one_builder(target, deadline_s=30):
        target.mkdir()
    assert target.is_dir()


def test_an_adapter_in_s3_is_copied_once_again_when_it_changes_and_old_copies_are_dropped(
    tmp_path, s3_server, monkeypatch
):
    """An adapter folder (no config.json) copied once, not on every fetch; replaced at the same URL, it is copied
    anew into a folder of its own (the old one, possibly still read, untouched) and served; only the two newest
    copies of a URL are kept."""
    import fsspec

    from ladle.platform import storage
    from ladle.serve.server import adapter_folder

    for key, value in s3_server.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("LADLE_HOME", str(tmp_path / "home"))
    url = "s3://ladle/adapters/bot"

    def publish(weights: bytes) -> None:
        with fsspec.open(f"{url}/adapter_config.json", "wb") as fh:
            fh.write(b'{"peft_type": "LORA"}')
        with fsspec.open(f"{url}/adapter_model.safetensors", "wb") as fh:
            fh.write(weights)

    publish(b"first")
    downloads = []
    real = storage.download_dir
    monkeypatch.setattr(storage, "download_dir", lambda *a: downloads.append(a[0]) or real(*a))
    first = adapter_folder(url)
    assert adapter_folder(url) == first and downloads == [url], "copied once"
    publish(b"second!")  # the same URL, other weights
    second = adapter_folder(url)
    assert second != first and (second / "adapter_model.safetensors").read_bytes() == b"second!"
    assert (first / "adapter_model.safetensors").read_bytes() == b"first", "a copy in use is never replaced"
    publish(b"third, longer")
    third = adapter_folder(url)
    assert sorted(p.name for p in third.parent.iterdir()) == sorted([second.name, third.name])
