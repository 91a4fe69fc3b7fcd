"""Model downloads: a model folder as a tar stream whose bytes are known before the first one is sent.

``GET /v1/models/{id}/content`` sends the files of a fine-tuned model or checkpoint at the root of an
uncompressed tar: the merged ``model.safetensors``, ``config.json``, ``generation_config.json`` and
the tokenizer files (``?format=adapter``: the peft adapter's files instead), so that after
``tar -xf model.tar -C out`` ``AutoModelForCausalLM.from_pretrained("out")`` (or
``PeftModel.from_pretrained(base, "out")``) loads it. The training state and the checkpoint manifest
stay on the server.

The archive is deterministic: members sorted by name, regular files only, mode 0644, owner 0, and
one mtime (the model's registration time), so its length is known from the file sizes alone
(``Content-Length``) and its SHA-256 is a property of the model. A checksum header must precede a
body that is streamed, so the digest is computed by one read pass on the first download of a model
(:func:`tar_sha256`) and cached in its row (``models.content_sha256`` / ``adapter_sha256``, cleared
whenever the row is pointed at other files); later downloads stream at once. A file that changed
size since the listing stops the stream (the body then falls short of its ``Content-Length``).
"""

from __future__ import annotations

import hashlib
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from store.model_ids import ADAPTER_DIR

DownloadFormat = Literal["model", "adapter"]
#: Files of a model folder that are not part of the model (trainer.run.checkpoint's layout).
SERVER_ONLY = frozenset({"training_state.pt", "zenflow_checkpoint.json"})
CHUNK_BYTES = 1 << 20
_BLOCK = tarfile.BLOCKSIZE
_RECORD = tarfile.RECORDSIZE


@dataclass(frozen=True)
class Member:
    name: str
    path: Path
    size: int


def _pad(n: int, unit: int) -> int:
    return -n % unit


def model_members(folder: Path, fmt: DownloadFormat) -> list[Member]:
    """The files a download of ``folder`` holds, by name in the archive (sorted): the model's files
    (no adapter folder, no training state) or, for ``adapter``, the adapter folder's files."""
    root = folder / ADAPTER_DIR if fmt == "adapter" else folder
    members = []
    for p in root.rglob("*"):
        rel = p.relative_to(root)
        if p.is_symlink() or not p.is_file():
            continue
        if fmt == "model" and (
            rel.parts[0] == ADAPTER_DIR or rel.name in SERVER_ONLY or rel.name.startswith(".")
        ):
            continue
        members.append(Member(rel.as_posix(), p, p.stat().st_size))
    return sorted(members, key=lambda m: m.name)


def _header(m: Member, mtime: int) -> bytes:
    info = tarfile.TarInfo(m.name)
    info.size, info.mtime, info.mode, info.type = m.size, mtime, 0o644, tarfile.REGTYPE
    return info.tobuf(format=tarfile.PAX_FORMAT)


def _trailer(length: int) -> bytes:
    """End-of-archive: two zero blocks, then zeros to a whole record (what tarfile itself writes)."""
    end = length + 2 * _BLOCK
    return b"\0" * (2 * _BLOCK + _pad(end, _RECORD))


def tar_length(members: list[Member], mtime: int) -> int:
    """The archive's length in bytes, from the listing alone."""
    n = sum(len(_header(m, mtime)) + m.size + _pad(m.size, _BLOCK) for m in members)
    return n + len(_trailer(n))


def tar_stream(members: list[Member], mtime: int, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """The archive in chunks of at most ``chunk_bytes`` (plus headers); never a whole file in memory."""
    sent = 0
    for m in members:
        header = _header(m, mtime)
        yield header
        left = m.size
        with open(m.path, "rb") as f:
            while left > 0:
                chunk = f.read(min(chunk_bytes, left))
                if not chunk:
                    raise OSError(f"{m.name} shrank while it was being sent")
                left -= len(chunk)
                yield chunk
        if m.path.stat().st_size != m.size:
            raise OSError(f"{m.name} changed size while it was being sent")
        pad = _pad(m.size, _BLOCK)
        if pad:
            yield b"\0" * pad
        sent += len(header) + m.size + pad
    yield _trailer(sent)


def tar_sha256(members: list[Member], mtime: int) -> str:
    """SHA-256 (hex) of the archive :func:`tar_stream` sends, by one read pass over the files."""
    digest = hashlib.sha256()
    for chunk in tar_stream(members, mtime):
        digest.update(chunk)
    return digest.hexdigest()


def archive_name(model_id: str, fmt: DownloadFormat) -> str:
    """A file name for the download (``:`` is not portable in file names)."""
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in model_id)
    return f"{safe}{'-adapter' if fmt == 'adapter' else ''}.tar"
