"""The checkpoint format: atomic, self-validating directories on disk, the training state saved in them
(RNG states included), and the small file helpers the run writes its other outputs with.

Layout of a job's output directory::

    checkpoint-000010/          resumable checkpoint at step 10
        model.safetensors       weights (merged ones for LoRA), loadable with from_pretrained
        config.json, generation_config.json, tokenizer files
        adapter/                LoRA runs only: the peft adapter (PeftModel.from_pretrained)
        training_state.pt       engine state_dict (incl. the device values of the trainable params),
                                RNG states, step (= data position), loss history: its structure
                                (torch.save), each tensor replaced by a key into
        training_state.safetensors  its tensors, streamed (:func:`save_streamed`; version 1 files
                                hold their tensors inline and still load)
        engine-rank00001-of-00002.pt/.safetensors  a run of N > 1 ranks: each rank's engine shard and
                                RNG states, one pair per rank (training_state.pt then holds no engine
                                state)
        zenflow_checkpoint.json manifest, written last: step, kind, file sizes, metrics
    final/                      the exported fine-tuned model (no training_state.pt)
    result.json                 the TrainResult of a finished run

A directory is written as ``<name>.tmp-<random>``, every file and the directory fsynced, then renamed
to ``<name>`` (atomic on POSIX), and the parent fsynced. A directory counts as complete only when
its manifest parses and every file listed there has the recorded size, so a half-written checkpoint
(a crash mid-write leaves only the ``.tmp-`` name) is never picked for resume; leftovers are removed
by :func:`cleanup_partial`. A checkpoint of N ranks lists every rank's shard file in its manifest, so it is
complete only with all of them (:mod:`trainer.run.outputs` moves them in before the rename). A write that fails for want of space raises :class:`DiskFullError` ("no space left
while writing checkpoint N"), the partial directory removed and an existing one of the same name kept;
:func:`space_short` tells, before a run, whether one more checkpoint as large as the newest fits.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from contract.engine import ENGINE_MODES
from contract.hyperparameters import ResolvedHyperparameters
from contract.job import ResolvedJob

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from trainer.resolve import Pins

MANIFEST = "zenflow_checkpoint.json"
TRAINING_STATE = "training_state.pt"
#: Where a streamed state file (``X.pt``) keeps its tensors: ``X.safetensors`` beside it.
TENSORS_SUFFIX = ".safetensors"
#: Training state versions this module reads: 1 (tensors inline), 2 (tensors streamed beside it).
STATE_VERSIONS = (1, 2)
WEIGHTS = "model.safetensors"
FINAL_DIR = "final"
#: A sharded run's engine rows: a ``torch.distributed.checkpoint`` folder (:mod:`offload.dcp_state`).
ENGINE_DCP = "engine-dcp"
RESULT_FILE = "result.json"
_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")
_SHARD_RE = re.compile(r"^engine-rank(\d{5})-of-(\d{5})\.(pt|safetensors)$")
#: A write that failed while less than this was left on its filesystem failed for want of space: torch.save
#: reports ENOSPC as ``RuntimeError: [enforce fail at inline_container.cc:...]``, with no errno to go by.
_FULL_BELOW_BYTES = 1 << 20
_NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_NO_SPACE_TEXT = ("No space left on device", "os error 28", "Disk quota exceeded", "os error 122")


class DiskFullError(OSError):
    """A checkpoint (or another output) could not be written: no space left on its filesystem."""

    def __init__(self, what: str) -> None:
        super().__init__(errno.ENOSPC, f"no space left while writing {what}")

    def __str__(self) -> str:
        return str(self.strerror)


def is_out_of_space(exc: BaseException, where: Path | None = None) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a write that failed for want of space:
    ENOSPC/EDQUOT, the same in a library's message (safetensors), or any error while less than 1 MiB is
    left at ``where``."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, DiskFullError) or (isinstance(e, OSError) and e.errno in _NO_SPACE_ERRNOS):
            return True
        if any(t in str(e) for t in _NO_SPACE_TEXT):
            return True
        e = e.__cause__ or e.__context__
    if where is not None and isinstance(exc, Exception):
        try:
            st = os.statvfs(where)
        except OSError:
            return False
        return st.f_bavail * st.f_frsize < _FULL_BELOW_BYTES
    return False


def checkpoint_name(step: int) -> str:
    return f"checkpoint-{step:06d}"


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path

    @property
    def manifest(self) -> dict[str, Any]:
        return read_manifest(self.path) or {}


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _listing(root: Path) -> dict[str, int]:
    return {
        str(p.relative_to(root)): p.stat().st_size
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }


def write_atomic_dir(
    target: Path,
    write: Callable[[Path], None],
    manifest: dict[str, Any],
    *,
    durable: bool = True,
    what: str | None = None,
) -> Path:
    """Run ``write(tmp_dir)``, add the manifest, fsync, and rename the directory to ``target``.

    An existing ``target`` (a re-save of the same step) is replaced. A write that runs out of space
    raises :class:`DiskFullError` naming ``what`` (default: "checkpoint N", "the final model" or the
    directory's name); the partial directory is removed and ``target`` left as it was.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        write(tmp)
        files = _listing(tmp)
        body = {
            "format": "zenflow-checkpoint",
            "version": 1,
            "created_at": datetime.now(UTC).isoformat(),
            **manifest,
            "files": files,
        }
        (tmp / MANIFEST).write_text(json.dumps(body, indent=2, default=str))
        if durable:
            for p in tmp.rglob("*"):
                _fsync_path(p)
            _fsync_path(tmp)
        old: Path | None = None
        if target.exists():
            old = target.with_name(f"{target.name}.old-{uuid.uuid4().hex[:8]}")
            os.rename(target, old)
        os.rename(tmp, target)
        if durable:
            _fsync_path(target.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException as e:
        full = is_out_of_space(e, tmp)  # before the partial directory's space is given back
        shutil.rmtree(tmp, ignore_errors=True)
        if full and not isinstance(e, DiskFullError):
            raise DiskFullError(what or _describe(target)) from e
        raise
    return target


def _describe(target: Path) -> str:
    m = _CKPT_RE.match(target.name)
    if m:
        return f"checkpoint {int(m.group(1))}"
    return "the final model" if target.name == FINAL_DIR else target.name


def read_manifest(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((Path(path) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_complete(path: Path) -> bool:
    """True when the manifest parses and all files it lists exist with their recorded sizes."""
    m = read_manifest(path)
    if m is None or not isinstance(m.get("files"), dict):
        return False
    for rel, size in m["files"].items():
        p = Path(path) / rel
        if not p.is_file() or p.stat().st_size != size:
            return False
    return True


def list_checkpoints(output_dir: Path) -> list[CheckpointInfo]:
    """Complete checkpoints, oldest first."""
    out: list[CheckpointInfo] = []
    if not Path(output_dir).is_dir():
        return out
    for p in Path(output_dir).iterdir():
        m = _CKPT_RE.match(p.name)
        if m and p.is_dir() and is_complete(p):
            out.append(CheckpointInfo(int(m.group(1)), p))
    return sorted(out, key=lambda c: c.step)


def latest_checkpoint(output_dir: Path) -> CheckpointInfo | None:
    """The newest complete checkpoint, or None."""
    cks = list_checkpoints(output_dir)
    return cks[-1] if cks else None


#: The manifest key of the engine settings a checkpoint was made with (what a resumed run keeps).
MANIFEST_ENGINE = "engine"


def checkpoint_pins(output_dir: Path) -> Pins | None:
    """What a run resuming from ``output_dir``'s newest checkpoint keeps of it: its engine mode and
    accumulator (the manifest's; None without a checkpoint or for one made before they were recorded)."""
    from trainer.resolve import Pins

    ckpt = latest_checkpoint(output_dir)
    engine = ckpt.manifest.get(MANIFEST_ENGINE) if ckpt is not None else None
    if not isinstance(engine, dict) or engine.get("mode") not in ENGINE_MODES:
        return None
    acc = engine.get("accumulate_on")
    return Pins(engine["mode"], acc if acc in ("host", "device") and engine["mode"] == "zenflow" else None)


def training_signature(of: ResolvedJob | dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint must agree with to be resumed exactly, of a resolved job or of a checkpoint's
    training state: the hyperparameters' signature and the method (a state recorded before methods were
    their own names DPO in its hyperparameters' ``dpo``)."""
    if isinstance(of, ResolvedJob):
        return {**of.hyperparameters.training_signature(), "method": of.method.model_dump(mode="json")}
    hp = of["hyperparameters"]
    legacy_dpo = hp.get("dpo") if isinstance(hp, dict) else None
    method = of.get("method") or (
        {"type": "dpo", "beta": legacy_dpo["beta"]}
        if isinstance(legacy_dpo, dict)
        else {"type": "supervised"}
    )
    return {**ResolvedHyperparameters(**hp).training_signature(), "method": method}


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def space_short(output_dir: Path) -> str | None:
    """Why one more checkpoint cannot be written in ``output_dir`` (its filesystem has less free than
    its newest complete checkpoint takes, plus the 1 MiB a write that fails below counts as full), as
    a :class:`DiskFullError` would say it; None when there is room, or no checkpoint tells the size."""
    ck = latest_checkpoint(output_dir)
    if ck is None:
        return None
    files = ck.manifest.get("files")
    need = sum(v for v in files.values() if isinstance(v, int)) if isinstance(files, dict) else 0
    try:
        st = os.statvfs(output_dir)
    except OSError:
        return None
    free = st.f_bavail * st.f_frsize
    if free >= need + _FULL_BELOW_BYTES:
        return None
    return (
        f"no space left for another checkpoint: {_mib(free)} free where {ck.path.name} "
        f"(step {ck.step}) takes {_mib(need)} and {_mib(_FULL_BELOW_BYTES)} is kept free"
    )


def cleanup_partial(output_dir: Path) -> list[Path]:
    """Remove ``*.tmp-*`` / ``*.old-*`` leftovers of interrupted writes (call with no writer active)."""
    removed = []
    if Path(output_dir).is_dir():
        for p in Path(output_dir).iterdir():
            if ".tmp-" in p.name or ".old-" in p.name:
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
                removed.append(p)
    return removed


def prune_checkpoints(output_dir: Path, keep: int | None) -> list[CheckpointInfo]:
    """Delete all but the newest ``keep`` complete checkpoints; returns the removed ones."""
    if keep is None:
        return []
    cks = list_checkpoints(output_dir)
    doomed = cks[:-keep] if len(cks) > keep else []
    for c in doomed:
        shutil.rmtree(c.path, ignore_errors=True)
    return doomed


def remove_outputs(output_dir: Path) -> None:
    """Delete this module's outputs (checkpoints, final model, result) to start a run afresh."""
    for c in list_checkpoints(output_dir):
        shutil.rmtree(c.path, ignore_errors=True)
    shutil.rmtree(Path(output_dir) / FINAL_DIR, ignore_errors=True)
    (Path(output_dir) / RESULT_FILE).unlink(missing_ok=True)
    cleanup_partial(output_dir)


def export_names(state: Mapping[str, torch.Tensor], tie_word_embeddings: bool) -> list[str]:
    """The names to write: tied copies (sharing storage with an earlier tensor) dropped, and
    ``lm_head.weight`` when tied to the embeddings; nothing copied."""
    seen: set[tuple[str, int, int, tuple[int, ...]]] = set()
    out: list[str] = []
    for name, t in state.items():
        key = (str(t.device), t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(t.shape))
        if key in seen and t.numel() > 0 and tie_word_embeddings:
            continue
        seen.add(key)
        out.append(name)
    if (
        tie_word_embeddings
        and "lm_head.weight" in out
        and any(k.endswith("embed_tokens.weight") for k in out)
    ):
        out.remove("lm_head.weight")
    return out


def save_model_files(
    directory: Path,
    state: Mapping[str, torch.Tensor],
    config: PretrainedConfig,
    tokenizer: PreTrainedTokenizerBase | None,
    generation_config: Any = None,
    *,
    fetch: Callable[[str], torch.Tensor] | None = None,
    names: list[str] | None = None,
) -> None:
    """Write weights (one safetensors file, tensor by tensor: :func:`offload.state_io.write_safetensors`),
    config and tokenizer so from_pretrained loads them. ``fetch(name)``: each weight's value, made
    when it is written (``state`` then gives the dtypes and shapes only). ``names``: the weights to
    write, when the caller chose them (:func:`export_names`), in the order they are fetched."""
    from offload.state_io import write_safetensors

    tied = bool(getattr(config, "tie_word_embeddings", False))
    names = names if names is not None else export_names(state, tied)
    write_safetensors(Path(directory) / WEIGHTS, {n: state[n] for n in names}, {"format": "pt"}, fetch=fetch)
    config.save_pretrained(directory)
    if generation_config is not None:
        generation_config.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


def tensors_path(path: Path) -> Path:
    """The tensors file of streamed state file ``path``."""
    return Path(path).with_suffix(TENSORS_SUFFIX)


def save_streamed(path: Path, state: dict[str, Any]) -> None:
    """``state`` as ``path`` (its structure, torch.save) and :func:`tensors_path` (its tensors, each
    written from where it lives: no copy of the engine's host buffers, device tensors copied one at a
    time). The tensors must not change until this returns."""
    import torch

    from offload.state_io import split_tensors, write_safetensors

    skeleton, tensors = split_tensors(state)
    write_safetensors(tensors_path(path), tensors)
    torch.save({**skeleton, "streamed": True}, path)


def load_streamed(path: Path) -> dict[str, Any]:
    """A state saved by :func:`save_streamed` (its large tensors mapped from the file, read when
    copied into place), or by torch.save (version 1: tensors inline, the file mapped)."""
    import torch

    from offload.state_io import join_tensors, read_safetensors

    state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    version = state.get("version", 1)
    if version not in STATE_VERSIONS:
        raise ValueError(
            f"{path}: training state version {version!r}; this trainer reads versions {list(STATE_VERSIONS)}"
        )
    if not state.pop("streamed", False):
        return state
    joined: dict[str, Any] = join_tensors(state, read_safetensors(tensors_path(path)))
    return joined


def save_training_state(directory: Path, state: dict[str, Any]) -> None:
    save_streamed(Path(directory) / TRAINING_STATE, state)


def load_training_state(directory: Path) -> dict[str, Any]:
    """Our own file (RNG states hold numpy arrays), so weights_only=False."""
    return load_streamed(Path(directory) / TRAINING_STATE)


def engine_shard_name(rank: int, world_size: int) -> str:
    """The file of one rank's engine shard and RNG states in a checkpoint of ``world_size`` > 1 ranks."""
    return f"engine-rank{rank:05d}-of-{world_size:05d}.pt"


def is_engine_shard(name: str) -> bool:
    return _SHARD_RE.match(name) is not None


def checkpoint_world_size(state: dict[str, Any]) -> int:
    """The ranks that wrote a checkpoint (its training state); 1 for a single-process one."""
    return int(state.get("world_size", 1))


def save_rank_state(path: Path, state: dict[str, Any]) -> None:
    """One rank's state as ``path`` and its :func:`tensors_path` (:func:`save_streamed`)."""
    save_streamed(path, state)


def load_rank_state(directory: Path, rank: int, world_size: int) -> dict[str, Any]:
    """One rank's ``{"engine", "rng", ...}`` from a checkpoint of ``world_size`` ranks (for 1: training_state.pt)."""
    if world_size == 1:
        return load_training_state(directory)
    return load_streamed(Path(directory) / engine_shard_name(rank, world_size))


# --- RNG states (saved in training_state.pt) ----------------------------------------------------


def seed_all(seed: int) -> None:
    """Seed Python's, numpy's and torch's global generators for a fresh run."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed % 2**63)


def rng_state() -> dict[str, Any]:
    """The global generators' states (CUDA's only when CUDA is initialized), for save_training_state."""
    import numpy as np
    import torch

    cuda = (
        torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    )
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": cuda,
    }


def set_rng_state(state: dict[str, Any], seed: int) -> None:
    """Restore saved generators; CUDA's from ``seed`` when the checkpoint was made without CUDA."""
    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available():
        if state.get("cuda") is not None:
            torch.cuda.set_rng_state_all(state["cuda"])
        else:
            torch.cuda.manual_seed_all(seed % 2**63)


# --- file helpers -------------------------------------------------------------------------------


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON to a temporary sibling, fsync it, and rename it over ``path``."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("w") as fh:
            json.dump(data, fh, indent=2)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if is_out_of_space(e):
            raise DiskFullError(path.name) from e
        raise


def link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link ``src`` to ``dst`` (creating dst's parents), or copy it where linking fails."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
