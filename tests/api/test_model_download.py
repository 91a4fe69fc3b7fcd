"""api.model_download: the download tar is what tarfile reads back, of the length and checksum known
before it is sent, streamed in bounded chunks, the same bytes every time, and never half a file; it
holds the model's files only (an allow-list: no training state of any rank, no manifest, no pickle);
any byte range of it is the same bytes as the whole archive's. api.byte_ranges: which range a
``Range`` header asks for, and when ``If-Range`` lets it."""

from __future__ import annotations

import hashlib
import io
import itertools
import os
import random
import tarfile
from pathlib import Path, PurePosixPath

import pytest

from api import model_download as dl
from api.byte_ranges import ByteRange, RangeNotSatisfiable, http_date, if_range_holds, parse_range

#: Over ustar's 100 characters: a PAX header.
LONG = "additional_chat_templates/" + "tool-use-" + "x" * 120 + ".jinja"
#: What a checkpoint of a 2-rank run holds besides the model (trainer.run.checkpoint's layout), and
#: files no download may carry whatever a future format calls them.
SERVER_SIDE = [
    "training_state.pt",
    "engine-rank00000-of-00002.pt",
    "engine-rank00001-of-00002.pt",
    "zenflow_checkpoint.json",
    "optimizer.pt",
    "pytorch_model.bin",
    "rng_state.pth",
    "notes.txt",
    ".hidden.json",
]


def _folder(tmp_path: Path) -> Path:
    folder = tmp_path / "checkpoint-000004"
    (folder / "adapter").mkdir(parents=True)
    (folder / "additional_chat_templates").mkdir()
    (folder / "model.safetensors").write_bytes(os.urandom(3 * 1024 * 1024 + 5))
    (folder / "config.json").write_text("{}")
    (folder / "tokenizer.json").write_text('{"model": {}}')
    (folder / LONG).write_text("{{ messages }}")
    for name in SERVER_SIDE:
        (folder / name).write_bytes(b"state" * 1000)
    (folder / "adapter" / "adapter_model.safetensors").write_bytes(b"lora")
    (folder / "adapter" / "adapter_config.json").write_text("{}")
    (folder / "adapter" / "training_state.pt").write_bytes(b"state")
    (folder / "elsewhere.json").symlink_to("/etc/hostname")
    (folder / "generation_config.json").symlink_to("/etc/hostname")  # an allowed name, but a link
    return folder


MODEL_NAMES = sorted(["model.safetensors", "config.json", "tokenizer.json", LONG])


def test_the_tar_reads_back_with_known_length_and_checksum(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    members = dl.model_members(folder, "model")
    assert [m.name for m in members] == MODEL_NAMES
    chunks = list(dl.tar_stream(members, mtime=1_700_000_000, chunk_bytes=64 * 1024))
    assert max(len(c) for c in chunks) <= 64 * 1024
    body = b"".join(chunks)
    assert len(body) == dl.TarLayout(members, 1_700_000_000).length
    assert hashlib.sha256(body).hexdigest() == dl.tar_sha256(members, 1_700_000_000)
    assert b"".join(dl.tar_stream(members, mtime=1_700_000_000)) == body  # deterministic
    with tarfile.open(fileobj=io.BytesIO(body)) as tar:
        assert sorted(tar.getnames()) == MODEL_NAMES
        weights = tar.extractfile("model.safetensors")
        assert weights is not None and weights.read() == (folder / "model.safetensors").read_bytes()
        assert all(i.mtime == 1_700_000_000 and i.mode == 0o644 and i.uid == 0 for i in tar.getmembers())

    adapter = dl.model_members(folder, "adapter")
    assert [m.name for m in adapter] == ["adapter_config.json", "adapter_model.safetensors"]
    with tarfile.open(fileobj=io.BytesIO(b"".join(dl.tar_stream(adapter, 0)))) as tar:
        assert tar.getnames() == ["adapter_config.json", "adapter_model.safetensors"]


def test_only_the_model_files_go_in(tmp_path: Path) -> None:
    """An allow-list: a 2-rank checkpoint's shards, the training state, the manifest, pickles and
    files of no known use stay on the server, in both formats; sharded safetensors weights go in."""
    folder = _folder(tmp_path)
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        (folder / name).write_bytes(b"w")
    (folder / "model.safetensors.index.json").write_text("{}")
    names = [m.name for m in dl.model_members(folder, "model")]
    assert not set(names) & set(SERVER_SIDE)
    assert not [n for n in names if n.endswith((".pt", ".pth", ".bin"))]
    assert {"model-00001-of-00002.safetensors", "model.safetensors.index.json"} <= set(names)
    for name in [*SERVER_SIDE, "elsewhere.json", "engine-rank00000-of-00002.safetensors"]:
        assert not dl.is_model_file(PurePosixPath(name)), name
    assert not dl.is_model_file(PurePosixPath("adapter/adapter_config.json"))
    assert not dl.is_model_file(PurePosixPath("additional_chat_templates/x.pt"))
    assert dl.is_model_file(PurePosixPath("adapter_model.safetensors"))  # at the adapter folder's root


def test_any_range_is_the_same_bytes_as_the_whole(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    members = dl.model_members(folder, "model")
    layout = dl.TarLayout(members, 1_700_000_000)
    body = b"".join(layout.stream())
    assert len(body) == layout.length
    # every piece boundary and its neighbours, then random ranges
    edges = sorted({p.offset + d for p in layout.pieces for d in (-1, 0, 1)} | {layout.length})
    edges = [e for e in edges if 0 <= e <= layout.length]
    rng = random.Random(0)
    ranges = list(itertools.pairwise(edges))
    for _ in range(200):
        a, b = sorted(rng.sample(range(layout.length + 1), 2))
        ranges.append((a, b))
    for start, end in ranges:
        assert b"".join(layout.stream(start, end, chunk_bytes=4096)) == body[start:end], (start, end)
    assert b"".join(layout.stream(5, 5)) == b""
    with pytest.raises(ValueError):
        list(layout.stream(0, layout.length + 1))


def test_a_file_that_shrinks_mid_stream_stops_it(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    members = dl.model_members(folder, "model")
    stream = dl.tar_stream(members, 0, chunk_bytes=1024 * 1024)
    next(stream)  # the first member's header
    (folder / LONG).write_text("")
    with pytest.raises(OSError, match=r"tool-use-x+\.jinja shrank"):
        list(stream)


def test_validators_follow_the_files(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    members = dl.model_members(folder, "model")
    tag = dl.listing_tag(members, 1, "d" * 64)
    assert tag.startswith('"') and tag.endswith('"') and tag == dl.listing_tag(members, 1, "d" * 64)
    assert dl.listing_tag(members, 2, "d" * 64) != tag and dl.listing_tag(members, 1, "e" * 64) != tag
    (folder / "config.json").unlink()
    (folder / "config.json").write_text("{}")  # the same size, rewritten
    assert dl.listing_tag(dl.model_members(folder, "model"), 1, "d" * 64) != tag
    assert dl.last_modified(members, 10**10) == 10**10
    assert dl.last_modified(members, 0) == max(int(m.path.stat().st_mtime) for m in members)


@pytest.mark.parametrize(
    ("header", "want"),
    [
        (None, None),
        ("bytes=0-99", ByteRange(0, 100, 1000)),
        ("bytes=100-", ByteRange(100, 1000, 1000)),
        ("bytes=990-5000", ByteRange(990, 1000, 1000)),
        ("bytes=-10", ByteRange(990, 1000, 1000)),
        ("bytes=-5000", ByteRange(0, 1000, 1000)),
        ("Bytes = 5 - 5", ByteRange(5, 6, 1000)),
        ("bytes=0-0,10-20", None),  # several ranges: the whole body
        ("bytes=20-10", None),  # invalid: ignored
        ("items=0-10", None),
        ("bytes=a-b", None),
        ("bytes=-", None),
        ("bytes 0-10", None),
    ],
)
def test_parse_range(header: str | None, want: ByteRange | None) -> None:
    assert parse_range(header, 1000) == want


@pytest.mark.parametrize("header", ["bytes=1000-", "bytes=1000-2000", "bytes=-0", "bytes=5000-"])
def test_unsatisfiable_ranges(header: str) -> None:
    with pytest.raises(RangeNotSatisfiable) as exc:
        parse_range(header, 1000)
    assert exc.value.content_range == "bytes */1000"
    assert ByteRange(0, 100, 1000).content_range == "bytes 0-99/1000"


def test_if_range() -> None:
    when = 1_700_000_000
    assert if_range_holds(None, etag='"a"', last_modified=when)
    assert if_range_holds('"a"', etag='"a"', last_modified=when)
    assert not if_range_holds('"b"', etag='"a"', last_modified=when)
    assert not if_range_holds('W/"a"', etag='"a"', last_modified=when)  # weak: never for ranges
    assert if_range_holds(http_date(when), etag='"a"', last_modified=when)
    assert not if_range_holds(http_date(when - 1), etag='"a"', last_modified=when)
    assert not if_range_holds("yesterday", etag='"a"', last_modified=when)


def test_archive_name_is_portable() -> None:
    assert dl.archive_name("ft:tiny-llama:ml-team::ftjob-1:ckpt-step-4", "adapter") == (
        "ft_tiny-llama_ml-team__ftjob-1_ckpt-step-4-adapter.tar"
    )
