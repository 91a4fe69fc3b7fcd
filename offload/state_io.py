"""Streaming state files: tensors written straight from where they live, read back without a copy.

A checkpoint of a large model must not hold a second copy of the engine's state: the host store is
most of the machine's memory already (16 B per offloaded parameter, pinned). ``torch.save`` writes a
view's whole storage, and ``safetensors.torch.save_file`` turns every tensor into ``bytes`` before
writing anything, so neither fits. Here:

- :func:`write_safetensors` writes the safetensors format (loadable by ``safetensors`` and so by
  ``from_pretrained``) one tensor at a time: a CPU tensor (pinned or not, a view or not, as long as
  it is contiguous) goes from its own memory to the file; a device tensor is copied to the host alone,
  written, and dropped. The peak extra host memory is the largest device (or non-contiguous) tensor.
- :func:`read_safetensors` maps the file copy-on-write and returns tensors over the mapping: nothing
  is read until a tensor is used, and copying one into its pinned buffer reads it once through the
  page cache (no anonymous copy). Small tensors (under ``clone_below`` bytes) are cloned so that
  state kept after loading does not pin the file.
- :func:`split_tensors` / :func:`join_tensors`: a nested state (dicts, lists, tuples) into a small
  skeleton (picklable, tensors replaced by markers) and its tensors by path, and back.
"""

from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_BY_NAME = {v: k for k, v in _DTYPES.items()}
#: Bytes handed to one ``write`` call (bounded so that a huge tensor is not one syscall).
WRITE_CHUNK = 64 << 20
#: The marker a skeleton holds where a tensor was (its value: the tensor's key).
MARKER = "__zenflow_tensor__"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def write_safetensors(
    path: Path | str,
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
    *,
    fetch: Callable[[str], torch.Tensor] | None = None,
) -> int:
    """Write ``tensors`` to ``path`` in the safetensors format without copying CPU tensors (see the
    module docstring); returns the bytes written. Tensors are laid out largest element first, so every
    tensor starts aligned to its element size in a mapping of the file.

    ``fetch(name)``: the data to write for ``name``, asked for one tensor at a time while writing (a
    lazily made copy, dropped once written); ``tensors`` then gives only each one's dtype and shape
    (device or meta tensors do)."""
    names = sorted(tensors, key=lambda n: -tensors[n].element_size())
    header: dict[str, Any] = {}
    off = 0
    for name in names:
        t = tensors[name]
        if t.dtype not in _DTYPES:
            raise TypeError(f"cannot write tensor {name!r} of dtype {t.dtype}")
        n = _nbytes(t)
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + n]}
        off += n
    if metadata:
        header["__metadata__"] = dict(metadata)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for name in names:
            t = tensors[name] if fetch is None else fetch(name)
            if t.dtype != tensors[name].dtype or t.shape != tensors[name].shape:
                raise ValueError(f"tensor {name!r} changed while being written: {t.dtype} {tuple(t.shape)}")
            _write_tensor(f, t)
    return 8 + len(head) + off


def _write_tensor(f: Any, t: torch.Tensor) -> None:
    if t.numel() == 0:
        return
    t = t.detach()
    if t.device.type != "cpu":
        # One tensor on the host at a time. A blocking copy on the current stream: it follows the
        # work queued there (the engine's compute stream) and has landed when it returns.
        t = t.to("cpu")
    t = t.contiguous()  # a no-op for the engine's flat buffers and their views
    raw = t.reshape(-1).view(torch.uint8).numpy()
    view: memoryview = raw.data  # the tensor's own bytes, no copy
    for lo in range(0, len(view), WRITE_CHUNK):
        f.write(view[lo : lo + WRITE_CHUNK])


def read_safetensors(path: Path | str, *, clone_below: int = 1 << 20) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, mapped copy-on-write (see the module docstring)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        size = f.seek(0, 2)
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size > 8 + n else None
    base = 8 + n
    out: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _BY_NAME.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        a, b = info["data_offsets"]
        shape = tuple(int(s) for s in info["shape"])
        if b == a:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        assert mm is not None
        esize = torch.empty((), dtype=dtype).element_size()
        if (base + a) % esize:  # not aligned (a file written elsewhere): a copy of this one tensor
            raw = torch.frombuffer(mm, dtype=torch.uint8, count=b - a, offset=base + a).clone()
            out[name] = raw.view(dtype).view(shape)
            continue
        t = torch.frombuffer(mm, dtype=dtype, count=(b - a) // esize, offset=base + a).view(shape)
        out[name] = t.clone() if b - a < clone_below else t
    return out


def split_tensors(state: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """``(skeleton, tensors)``: ``state`` with every tensor replaced by ``{MARKER: key}``, and the tensors
    by key (their path in ``state``). The tensors are the state's own (no copies)."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            key = path if path not in tensors else f"{path}#{len(tensors)}"
            tensors[key] = obj
            return {MARKER: key}
        if isinstance(obj, dict):
            return {k: walk(v, f"{path}/{k}") for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            items = [walk(v, f"{path}/{i}") for i, v in enumerate(obj)]
            return items if isinstance(obj, list) else tuple(items)
        return obj

    return walk(state, ""), tensors


def join_tensors(skeleton: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """The inverse of :func:`split_tensors`."""

    def walk(obj: Any) -> Any:
        if isinstance(obj, dict):
            if len(obj) == 1 and MARKER in obj:
                return tensors[obj[MARKER]]
            return {k: walk(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        if isinstance(obj, tuple):
            return tuple(walk(v) for v in obj)
        return obj

    return walk(skeleton)


def largest(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the largest tensor (what a streamed write holds at most on the host beyond the state)."""
    return max((_nbytes(t) for t in tensors), default=0)
