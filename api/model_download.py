"""Model downloads: a model folder as a tar whose bytes are known before the first one is sent.

``GET /v1/models/{id}/content`` sends the files of a fine-tuned model or checkpoint (or of a base model
a team may train on: a folder under the model roots, or a built-in config at a seed, written by
api.builtin_cache) at the root of an uncompressed tar: the merged ``model.safetensors``, ``config.json``, ``generation_config.json`` and
the tokenizer files (``?format=adapter``: the peft adapter's files instead), so that after
``tar -xf model.tar -C out`` ``AutoModelForCausalLM.from_pretrained("out")`` (or
``PeftModel.from_pretrained(base, "out")``) loads it.

What goes in is an allow-list (:func:`is_model_file`): the files ``from_pretrained`` reads, safetensors
weights only. Everything else in the folder stays on the server: the training state
(``training_state.pt``, each rank's ``engine-rankRRRRR-of-NNNNN.pt``: pickles that ``torch.load``
would execute, several times the model's size), the checkpoint manifest, and whatever a later
format adds, until it is named here.

The archive is deterministic: members sorted by name, regular files only, mode 0644, owner 0, and
one mtime (the model's registration time), so its layout and length follow from the file sizes
alone (:class:`TarLayout`): ``Content-Length`` is known up front and any byte range is produced by
reading just the files it covers (``Range`` requests, resumable downloads), nothing built in memory
or on disk. Its SHA-256 is a property of the model. A checksum header must precede a body that is
streamed, so the digest is computed by one read pass on the first download of a model
(:func:`tar_sha256`) and cached in its row (``models.content_sha256`` / ``adapter_sha256``, cleared
whenever the row is pointed at other files); later downloads stream at once. A file that changed
size since the listing stops the stream (the body then falls short of its ``Content-Length``).
"""

from __future__ import annotations

import hashlib
import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal

from store.model_ids import ADAPTER_DIR

DownloadFormat = Literal["model", "adapter"]

#: The files of a model (or peft adapter) folder a download holds, by exact name at the folder's root:
#: what ``from_pretrained`` (transformers, peft) reads, and the model card.
MODEL_FILES = frozenset(
    {
        # model
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "model.safetensors.index.json",
        # tokenizer
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "tokenizer.model",
        "spiece.model",
        "sentencepiece.bpe.model",
        "vocab.json",
        "vocab.txt",
        "merges.txt",
        "chat_template.jinja",
        "chat_template.json",
        # peft adapter
        "adapter_config.json",
        "adapter_model.safetensors",
        # model card
        "README.md",
    }
)
#: Sharded safetensors weights (``model-00001-of-00004.safetensors``, named by their index file).
_WEIGHT_SHARD = re.compile(r"^(model|adapter_model)-\d{5}-of-\d{5}\.safetensors$")
#: A tokenizer's extra chat templates (transformers writes them to this folder, one ``.jinja`` each).
TEMPLATES_DIR = "additional_chat_templates"

CHUNK_BYTES = 1 << 20
_BLOCK = tarfile.BLOCKSIZE
_RECORD = tarfile.RECORDSIZE


@dataclass(frozen=True)
class Member:
    name: str
    path: Path
    size: int


def is_model_file(rel: PurePosixPath) -> bool:
    """Whether the file at ``rel`` (relative to the model folder) is part of the model download."""
    if len(rel.parts) == 1:
        return rel.name in MODEL_FILES or _WEIGHT_SHARD.match(rel.name) is not None
    return (
        len(rel.parts) == 2
        and rel.parts[0] == TEMPLATES_DIR
        and rel.suffix == ".jinja"
        and not rel.name.startswith(".")
    )


def model_members(folder: Path, fmt: DownloadFormat) -> list[Member]:
    """The files a download of ``folder`` holds, by name in the archive (sorted): the model's files
    or, for ``adapter``, the adapter folder's; regular files named by :func:`is_model_file` only."""
    root = folder / ADAPTER_DIR if fmt == "adapter" else folder
    candidates = list(root.iterdir()) if root.is_dir() else []
    templates = root / TEMPLATES_DIR
    if templates.is_dir() and not templates.is_symlink():
        candidates += templates.iterdir()
    members = []
    for p in candidates:
        rel = PurePosixPath(p.relative_to(root).as_posix())
        if not is_model_file(rel) or p.is_symlink() or not p.is_file():
            continue
        members.append(Member(rel.as_posix(), p, p.stat().st_size))
    return sorted(members, key=lambda m: m.name)


def _pad(n: int, unit: int) -> int:
    return -n % unit


def _header(m: Member, mtime: int) -> bytes:
    info = tarfile.TarInfo(m.name)
    info.size, info.mtime, info.mode, info.type = m.size, mtime, 0o644, tarfile.REGTYPE
    return info.tobuf(format=tarfile.PAX_FORMAT)


@dataclass(frozen=True)
class _Piece:
    """A run of the archive's bytes at ``offset``: fixed bytes (headers, padding, the trailer) or a
    member's file content."""

    offset: int
    size: int
    data: bytes = b""
    member: Member | None = None


class TarLayout:
    """The archive of ``members`` (mtime ``mtime``) as offsets: its length, and any byte range of it
    read from the files that range covers."""

    def __init__(self, members: list[Member], mtime: int) -> None:
        pieces: list[_Piece] = []
        offset = 0

        def fixed(data: bytes) -> None:
            nonlocal offset
            if data:
                pieces.append(_Piece(offset, len(data), data=data))
                offset += len(data)

        for m in members:
            fixed(_header(m, mtime))
            if m.size:
                pieces.append(_Piece(offset, m.size, member=m))
                offset += m.size
            fixed(b"\0" * _pad(m.size, _BLOCK))
        # End of archive: two zero blocks, then zeros to a whole record (what tarfile itself writes).
        fixed(b"\0" * (2 * _BLOCK + _pad(offset + 2 * _BLOCK, _RECORD)))
        self.pieces = pieces
        self.length = offset

    def stream(
        self, start: int = 0, end: int | None = None, chunk_bytes: int = CHUNK_BYTES
    ) -> Iterator[bytes]:
        """Bytes ``[start, end)`` of the archive (default: all of it) in chunks of at most
        ``chunk_bytes``; never a whole file in memory."""
        end = self.length if end is None else end
        if not 0 <= start <= end <= self.length:
            raise ValueError(f"range [{start}, {end}) is outside the archive's {self.length} bytes")
        for piece in self.pieces:
            lo, hi = max(start, piece.offset), min(end, piece.offset + piece.size)
            if lo >= hi:
                continue
            if piece.member is None:
                yield piece.data[lo - piece.offset : hi - piece.offset]
            else:
                yield from _read(piece.member, lo - piece.offset, hi - piece.offset, chunk_bytes)


def _read(m: Member, lo: int, hi: int, chunk_bytes: int) -> Iterator[bytes]:
    """Bytes ``[lo, hi)`` of a member's file, which must still have its listed size."""
    with open(m.path, "rb") as f:
        f.seek(lo)
        left = hi - lo
        while left > 0:
            chunk = f.read(min(chunk_bytes, left))
            if not chunk:
                raise OSError(f"{m.name} shrank while it was being sent")
            left -= len(chunk)
            yield chunk
    if m.path.stat().st_size != m.size:
        raise OSError(f"{m.name} changed size while it was being sent")


def tar_stream(members: list[Member], mtime: int, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """The whole archive in chunks of at most ``chunk_bytes``."""
    return TarLayout(members, mtime).stream(chunk_bytes=chunk_bytes)


def tar_sha256(members: list[Member], mtime: int) -> str:
    """SHA-256 (hex) of the archive :func:`tar_stream` sends, by one read pass over the files."""
    digest = hashlib.sha256()
    for chunk in tar_stream(members, mtime):
        digest.update(chunk)
    return digest.hexdigest()


def listing_tag(members: list[Member], mtime: int, digest: str) -> str:
    """A strong entity tag of the archive: its checksum and the files' names, sizes and modification
    times, so that a file rewritten under a cached checksum still changes it."""
    h = hashlib.sha256(f"{digest}\n{mtime}\n".encode())
    for m in members:
        st = m.path.stat()
        h.update(f"{m.name}\0{m.size}\0{st.st_mtime_ns}\0{st.st_ino}\n".encode())
    return f'"{h.hexdigest()[:32]}"'


def last_modified(members: list[Member], mtime: int) -> int:
    """The archive's last change, Unix seconds: its registration time or its newest file's."""
    return max([mtime, *(int(m.path.stat().st_mtime) for m in members)])


def archive_name(model_id: str, fmt: DownloadFormat) -> str:
    """A file name for the download (``:`` is not portable in file names)."""
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in model_id)
    return f"{safe}{'-adapter' if fmt == 'adapter' else ''}.tar"


# --- base models -------------------------------------------------------------------------------------

#: Checksums of base-model tars (no row to keep them in), by the files' names, sizes and mtimes.
_BASE_DIGESTS: dict[tuple[object, ...], str] = {}
_BASE_DIGESTS_MAX = 256


def base_tar_sha256(members: list[Member], mtime: int) -> str:
    """:func:`tar_sha256` of a base model's download, remembered while its files stay the same."""
    key: tuple[object, ...] = (mtime, *((m.name, m.size, m.path.stat().st_mtime_ns) for m in members))
    digest = _BASE_DIGESTS.get(key)
    if digest is None:
        digest = tar_sha256(members, mtime)
        if len(_BASE_DIGESTS) >= _BASE_DIGESTS_MAX:
            _BASE_DIGESTS.clear()
        _BASE_DIGESTS[key] = digest
    return digest
