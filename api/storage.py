"""Uploads: a streaming multipart reader that hashes and size-checks while it writes a temp file.

Nothing is kept for a refused upload: the body is streamed to ``files_dir/.incoming/<random>.part``
(same filesystem as the final place), the size limit is enforced while streaming, and only after the
validator accepted the content is it moved into ``files_dir/<team>/<file id>.jsonl`` with os.replace.
A full disk (or quota) while storing is 507 ``insufficient_storage``, the temp file removed. Temp
files a killed process left behind are removed when the API starts (:meth:`LocalFileStore.sweep_incoming`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import DEFAULT_MAX_HEADER_SIZE, MultipartParser, parse_options_header
from starlette.requests import Request

from api.core.errors import APIError

log = logging.getLogger(__name__)

#: OSError numbers that mean "no room left here": a full file system or a disk quota.
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})
MAX_FIELD_BYTES = 64 * 1024
MAX_FIELDS = 16
#: Slack for multipart framing and small fields when pre-checking Content-Length.
FRAMING_SLACK = 1024 * 1024


@dataclass
class ReceivedUpload:
    tmp_path: Path
    filename: str | None = None
    content_type: str | None = None
    bytes: int = 0
    sha256: str = ""
    fields: dict[str, str] = field(default_factory=dict)

    def discard(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.tmp_path.unlink()


def too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"File is too large: the limit is {limit} bytes",
        param="file",
        code="file_too_large",
        headers={"Connection": "close"},
    )


def no_space(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in NO_SPACE


def insufficient_storage() -> APIError:
    return APIError(
        507,
        "The server has no storage left for this file; nothing was kept. Retry later, or ask the operator to free space",
        param="file",
        code="insufficient_storage",
        headers={"Connection": "close"},
    )


def _safe_filename(raw: str) -> str:
    name = raw.replace("\\", "/").rsplit("/", 1)[-1].strip().replace("\x00", "")
    return (name or "upload.jsonl")[:255]


class _Receiver:
    """Callbacks for python-multipart's streaming parser."""

    def __init__(self, out: IO[bytes], upload: ReceivedUpload, limit: int) -> None:
        self.out = out
        self.upload = upload
        self.limit = limit
        self.hasher = hashlib.sha256()
        self.header_name = b""
        self.header_value = b""
        self.disposition: bytes | None = None
        self.part_content_type: bytes | None = None
        self.field_name: str | None = None
        self.is_file = False
        self.seen_file = False
        self.buf = bytearray()

    def on_part_begin(self) -> None:
        self.disposition = None
        self.part_content_type = None
        self.field_name = None
        self.is_file = False
        self.buf = bytearray()

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self.header_name += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self.header_value += data[start:end]

    def on_header_end(self) -> None:
        name = self.header_name.lower()
        if name == b"content-disposition":
            self.disposition = self.header_value
        elif name == b"content-type":
            self.part_content_type = self.header_value
        self.header_name = b""
        self.header_value = b""

    def on_headers_finished(self) -> None:
        _, opts = parse_options_header(self.disposition)
        if b"name" not in opts:
            raise APIError(400, "A multipart part has no name", code="invalid_multipart")
        self.field_name = opts[b"name"].decode("utf-8", "replace")
        if b"filename" in opts:
            if self.field_name != "file" or self.seen_file:
                raise APIError(400, "Send exactly one file, in the field 'file'", param="file")
            self.is_file = self.seen_file = True
            self.upload.filename = _safe_filename(opts[b"filename"].decode("utf-8", "replace"))
            if self.part_content_type:
                self.upload.content_type = self.part_content_type.decode("latin-1")
        elif len(self.upload.fields) >= MAX_FIELDS:
            raise APIError(400, "Too many form fields", code="invalid_multipart")

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        chunk = data[start:end]
        if self.is_file:
            self.upload.bytes += len(chunk)
            if self.upload.bytes > self.limit:
                raise too_large(self.limit)
            self.hasher.update(chunk)
            self.out.write(chunk)
        else:
            if len(self.buf) + len(chunk) > MAX_FIELD_BYTES:
                raise APIError(400, f"Form field {self.field_name!r} is too long", param=self.field_name)
            self.buf.extend(chunk)

    def on_part_end(self) -> None:
        if not self.is_file and self.field_name is not None:
            self.upload.fields[self.field_name] = self.buf.decode("utf-8", "replace")


def _malformed(exc: FormParserError) -> APIError:
    if "header size" in str(exc):  # python-multipart's bound on one header line of a part
        return APIError(
            400,
            f"A multipart header line is longer than {DEFAULT_MAX_HEADER_SIZE} bytes: use a shorter file name "
            "(at most 255 bytes of it are kept)",
            param="file",
            code="invalid_multipart",
        )
    return APIError(400, "Malformed multipart body", param="file", code="invalid_multipart")


async def receive_upload(request: Request, incoming_dir: Path, limit: int) -> ReceivedUpload:
    """Stream a multipart body's ``file`` part to a temp file; the caller must ``discard()`` it."""
    ctype, params = parse_options_header(request.headers.get("content-type"))
    if ctype != b"multipart/form-data" or b"boundary" not in params:
        raise APIError(
            415 if ctype and ctype != b"multipart/form-data" else 400,
            "Upload files as multipart/form-data with the fields 'file' and 'purpose'",
            param="file",
            code="invalid_multipart",
        )
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > limit + FRAMING_SLACK:
        raise too_large(limit)

    upload = ReceivedUpload(tmp_path=incoming_dir / f"{secrets.token_hex(12)}.part")
    try:
        incoming_dir.mkdir(parents=True, exist_ok=True)
        with open(upload.tmp_path, "xb") as out:
            recv = _Receiver(out, upload, limit)
            parser = MultipartParser(
                params[b"boundary"],
                {
                    "on_part_begin": recv.on_part_begin,
                    "on_part_data": recv.on_part_data,
                    "on_part_end": recv.on_part_end,
                    "on_header_field": recv.on_header_field,
                    "on_header_value": recv.on_header_value,
                    "on_header_end": recv.on_header_end,
                    "on_headers_finished": recv.on_headers_finished,
                },
            )
            async for chunk in request.stream():
                parser.write(chunk)
            parser.finalize()
            out.flush()
            os.fsync(out.fileno())
        upload.sha256 = recv.hasher.hexdigest()
    except FormParserError as exc:
        upload.discard()
        raise _malformed(exc) from exc
    except OSError as exc:
        upload.discard()
        if no_space(exc):
            log.warning("upload refused: no space left in %s (%s)", incoming_dir, exc.strerror)
            raise insufficient_storage() from exc
        raise
    except BaseException:  # ClientDisconnect, a 413 or 400 from a callback, cancellation
        upload.discard()
        raise
    return upload


class LocalFileStore:
    """Files on a local (or mounted network/object-store FUSE) directory: ``root/<team>/<id>.jsonl``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @property
    def incoming(self) -> Path:
        return self.root / ".incoming"

    def place(self, tmp: Path, team_id: str, file_id: str) -> Path:
        final = self.root / team_id / f"{file_id}.jsonl"
        try:  # a new directory, or a directory entry, can need a block too
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, final)
        except OSError as exc:
            if no_space(exc):
                raise insufficient_storage() from exc
            raise
        return final

    def sweep_incoming(self, max_age_seconds: float) -> list[Path]:
        """Remove upload temp files not written to for ``max_age_seconds``: left by an API process
        that was killed mid-upload. Younger ones may be another replica's upload in progress."""
        removed: list[Path] = []
        cutoff = time.time() - max_age_seconds
        try:
            entries = list(os.scandir(self.incoming))
        except FileNotFoundError:
            return removed
        for entry in entries:
            if not entry.name.endswith(".part") or not entry.is_file(follow_symlinks=False):
                continue
            with contextlib.suppress(FileNotFoundError):
                if entry.stat(follow_symlinks=False).st_mtime < cutoff:
                    os.unlink(entry.path)
                    removed.append(Path(entry.path))
        return removed

    @staticmethod
    def remove(path: str | Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            Path(path).unlink()
