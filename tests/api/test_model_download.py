"""api.model_download: the download tar is what tarfile reads back, of the length and checksum known
before it is sent, streamed in bounded chunks, the same bytes every time, and never half a file."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from pathlib import Path

import pytest

from api import model_download as dl

LONG = "tokenizer-" + "x" * 120 + ".json"  # over ustar's 100 characters: a PAX header


def _folder(tmp_path: Path) -> Path:
    folder = tmp_path / "checkpoint-000004"
    (folder / "adapter").mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(os.urandom(3 * 1024 * 1024 + 5))
    (folder / "config.json").write_text("{}")
    (folder / LONG).write_text("{}")
    (folder / "training_state.pt").write_bytes(b"state")
    (folder / "zenflow_checkpoint.json").write_text("{}")
    (folder / "adapter" / "adapter_model.safetensors").write_bytes(b"lora")
    (folder / "adapter" / "adapter_config.json").write_text("{}")
    (folder / "elsewhere").symlink_to("/etc/hostname")
    return folder


def test_the_tar_reads_back_with_known_length_and_checksum(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    members = dl.model_members(folder, "model")
    assert [m.name for m in members] == sorted(["model.safetensors", "config.json", LONG])
    chunks = list(dl.tar_stream(members, mtime=1_700_000_000, chunk_bytes=64 * 1024))
    assert max(len(c) for c in chunks) <= 64 * 1024
    body = b"".join(chunks)
    assert len(body) == dl.tar_length(members, 1_700_000_000)
    assert hashlib.sha256(body).hexdigest() == dl.tar_sha256(members, 1_700_000_000)
    assert b"".join(dl.tar_stream(members, mtime=1_700_000_000)) == body  # deterministic
    with tarfile.open(fileobj=io.BytesIO(body)) as tar:
        assert sorted(tar.getnames()) == sorted(m.name for m in members)
        weights = tar.extractfile("model.safetensors")
        assert weights is not None and weights.read() == (folder / "model.safetensors").read_bytes()
        assert all(i.mtime == 1_700_000_000 and i.mode == 0o644 and i.uid == 0 for i in tar.getmembers())

    adapter = dl.model_members(folder, "adapter")
    assert [m.name for m in adapter] == ["adapter_config.json", "adapter_model.safetensors"]
    with tarfile.open(fileobj=io.BytesIO(b"".join(dl.tar_stream(adapter, 0)))) as tar:
        assert tar.getnames() == ["adapter_config.json", "adapter_model.safetensors"]


def test_a_file_that_shrinks_mid_stream_stops_it(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    members = dl.model_members(folder, "model")
    stream = dl.tar_stream(members, 0, chunk_bytes=1024 * 1024)
    next(stream)  # config.json's header
    (folder / "config.json").write_text("")
    with pytest.raises(OSError, match=r"config\.json shrank"):
        list(stream)


def test_archive_name_is_portable() -> None:
    assert dl.archive_name("ft:tiny-llama:ml-team::ftjob-1:ckpt-step-4", "adapter") == (
        "ft_tiny-llama_ml-team__ftjob-1_ckpt-step-4-adapter.tar"
    )
