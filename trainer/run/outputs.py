"""What the training run writes: resumable checkpoints (exported weights, LoRA adapter, the engine's
state, RNG states, the run's progress) and the ``final/`` model, both through
:func:`trainer.run.checkpoint.write_atomic_dir`.

Exported weights come from the engine's consolidated weights; for LoRA the merged model is written
plus ``adapter/``. Older checkpoints beyond ``keep_checkpoints`` are pruned after each save.

A checkpoint holds no second copy of the engine's state on the host: the engine's own tensors
(``engine.state_views()``: its pinned host buffers, device tensors) are written one at a time to
the state's ``.safetensors`` file (:func:`trainer.run.checkpoint.save_streamed`), and a full fine-tune's
weights are made and written one at a time too; the peak extra host memory is about the largest
tensor (the plan counts it: ``checkpoint`` in :mod:`trainer.plan.candidates`). LoRA runs export
from the whole merged state (their engine state is the small adapter).

With N > 1 data-parallel ranks every rank must call :meth:`RunOutputs.save_checkpoint`,
:meth:`~RunOutputs.export_final` and :meth:`~RunOutputs.write_result` at the same points (they hold
collectives). A checkpoint is written in two phases so that its directory only becomes complete with
every rank's shard in it:

1. each rank > 0 saves its engine shard and RNG states to ``<checkpoint>.tmp-engine-rankRRRRR-of-NNNNN.pt``
   (and its ``.safetensors``) beside the checkpoint (a ``.tmp-`` name: :func:`trainer.run.checkpoint.cleanup_partial` removes leftovers);
   the ranks then sum their failures (a collective every rank reaches), and all raise if any failed;
2. rank 0 writes the model files, ``training_state.pt`` (no engine state, ``world_size`` N) and its own
   shard into the temporary directory, moves the other ranks' staged files in, and only then lets
   :func:`~trainer.run.checkpoint.write_atomic_dir` write the manifest (which lists every shard file) and
   rename; its outcome (the path, or the error) is broadcast, so every rank raises when it failed.

Only rank 0 writes ``final/`` (the model files of the last checkpoint, no shard or training state) and
``result.json``, and prunes old checkpoints; only it emits CheckpointSaved/CheckpointRemoved.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from trainer.events import CheckpointRemoved, CheckpointSaved, Event
from trainer.model.lora import current_state, merged_lora_state
from trainer.run.checkpoint import (
    ENGINE_DCP,
    FINAL_DIR,
    MANIFEST,
    MANIFEST_ENGINE,
    RESULT_FILE,
    TRAINING_STATE,
    DiskFullError,
    checkpoint_name,
    engine_shard_name,
    is_engine_shard,
    is_out_of_space,
    link_or_copy,
    prune_checkpoints,
    rng_state,
    save_model_files,
    save_rank_state,
    save_training_state,
    tensors_path,
    write_atomic_dir,
    write_json_atomic,
)
from trainer.run.distributed import DistContext, all_sum, broadcast_object
from trainer.run.fsdp_model import FullWeights, gather_full_state
from trainer.run.model_card import CARD_FILE, model_card
from trainer.run.setup import Built, Progress, RunData
from trainer.spec import JobSpec

if TYPE_CHECKING:
    import torch

#: 2: tensors streamed beside the state file (trainer.run.checkpoint.save_streamed); 1 still loads.
STATE_VERSION = 2
#: Steps averaged for TrainResult.train_loss.
LOSS_WINDOW = 20

T = TypeVar("T")


def mean_loss(progress: Progress) -> float | None:
    w = progress.losses[-LOSS_WINDOW:]
    return sum(w) / len(w) if w else None


def metrics(progress: Progress) -> dict[str, Any]:
    """The run's figures as recorded in checkpoint and final manifests."""
    return {
        "step": progress.step,
        "train_loss": progress.losses[-1] if progress.losses else None,
        "train_mean_loss": mean_loss(progress),
        "valid_loss": progress.valid_loss,
        "trained_tokens": progress.trained_tokens,
    }


class RunOutputs:
    """Writes the checkpoints and the final model of one run into ``out`` (rank 0 writes the shared
    files; with several ranks each adds its engine shard to every checkpoint)."""

    def __init__(
        self,
        spec: JobSpec,
        out: Path,
        data: RunData,
        built: Built,
        emit: Callable[[Event], None],
        dist: DistContext | None = None,
    ) -> None:
        self.spec, self.out, self.data, self.built, self.emit = spec, out, data, built, emit
        self.dist = dist

    @property
    def is_main(self) -> bool:
        return self.dist is None or self.dist.is_main

    def _export(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
        """(model weights to write, LoRA adapter weights or None)."""
        model = self.built.model
        state = current_state(model, self.built.engine.consolidated_state_dict())
        if self.spec.lora is None:
            return state, None
        return merged_lora_state(model, state), state

    def _streamed_export(
        self, owned: set[str], weight_of: Callable[[str], torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], Callable[[str], torch.Tensor]]:
        """A full fine-tune's weights to write one at a time: the model's state dict (its own tensors,
        for names, dtypes and shapes) and the value of each name, made when it is written (the
        engine's newest value of a parameter it owns, as :func:`trainer.model.lora.current_state`)."""
        model = self.built.model
        refs: dict[str, torch.Tensor] = model.state_dict()
        names_by_ptr = {p.data_ptr(): n for n, p in model.named_parameters()}

        def fetch(key: str) -> torch.Tensor:
            v = refs[key]
            n = names_by_ptr.get(v.data_ptr())
            name = n if n in owned else key if key in owned else None
            return weight_of(name) if name is not None else v.detach().to("cpu")

        return refs, fetch

    def _on_main(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()`` run by rank 0 only; every rank gets its value, or raises when it failed there (a
        DiskFullError for want of space, like rank 0's)."""
        if self.dist is None:
            return fn()
        if self.dist.is_main:
            try:
                value = fn()
            except Exception as e:
                broadcast_object(self.dist, ("error", f"{type(e).__name__}: {e}", is_out_of_space(e)))
                raise
            broadcast_object(self.dist, ("ok", value, False))
            return value
        kind, value, full = broadcast_object(self.dist, None)
        if kind != "ok":
            if full:
                raise DiskFullError(what)
            raise RuntimeError(f"{what} failed on rank 0: {value}")
        return value  # type: ignore[no-any-return,unused-ignore]

    def _staged(self, step: int, rank: int) -> Path:
        """Where rank ``rank`` > 0 leaves its shard for rank 0 to move into checkpoint ``step``."""
        assert self.dist is not None
        return self.out / f"{checkpoint_name(step)}.tmp-{engine_shard_name(rank, self.dist.world_size)}"

    def _stage_shards(self, step: int, rank_state: dict[str, Any]) -> None:
        """Phase 1 (ranks > 0 save their shard beside the checkpoint); raises on every rank if any failed."""
        assert self.dist is not None
        dist = self.dist
        problem: BaseException | None = None
        staged = self._staged(step, dist.rank)
        if not dist.is_main:
            try:
                save_rank_state(staged, rank_state)
            except Exception as e:
                problem = e
        full = problem is not None and is_out_of_space(problem, self.out)
        n_full, n_failed = all_sum(dist, [float(full), float(problem is not None)])
        if n_failed == 0:
            return
        if not dist.is_main:
            staged.unlink(missing_ok=True)
            tensors_path(staged).unlink(missing_ok=True)
        if n_full > 0:
            raise DiskFullError(f"checkpoint {step}") from problem
        raise RuntimeError(
            f"checkpoint {step}: {int(n_failed)} rank(s) could not write their engine shard"
        ) from problem

    def _save_dcp(self, step: int, engine_state: dict[str, Any]) -> None:
        """Every rank writes its engine rows into the staged DCP folder of checkpoint ``step``
        (:mod:`offload.dcp_state`); rank 0 moves it in."""
        from offload.dcp_state import engine_pieces, save_rows

        assert self.dist is not None
        pieces, skeleton = engine_pieces(self.built.engine, engine_state["mode_state"])
        save_rows(self._staged_dcp(step), pieces, skeleton, self.dist.cpu_group or self.dist.group)

    def _staged_dcp(self, step: int) -> Path:
        return self.out / f"{checkpoint_name(step)}.tmp-{ENGINE_DCP}"

    def save_checkpoint(self, progress: Progress) -> None:
        """Write a checkpoint at ``progress.step``, record it in ``progress``, prune older ones."""
        built, dist, step = self.built, self.dist, progress.step
        # the engine's own tensors, not copies: valid until its next step, after this method returns
        engine_state, weight_of = built.engine.state_views()
        rng = rng_state()
        rank_state: dict[str, Any] = {}
        if dist is not None:
            rank_engine = engine_state
            if built.sharded:  # the rows through DCP, every rank its own; the shard file keeps the RNG
                self._save_dcp(step, engine_state)
                rank_engine = {**engine_state, "mode_state": None, "dcp": ENGINE_DCP}
            rank_state = {
                "version": STATE_VERSION,
                "step": step,
                "rank": dist.rank,
                "world_size": dist.world_size,
                "engine": rank_engine,
                "rng": rng,
            }
            self._stage_shards(step, rank_state)
        figures = metrics(progress)
        # sharded weights: every rank takes part in gathering each whole weight (LoRA: rank 0 keeps the
        # whole state to merge; a full fine-tune: one weight at a time, as rank 0 writes it)
        full = streamed = None
        if built.sharded and self.spec.lora is not None:
            full = gather_full_state(built.model, built.engine, keep=self.is_main)
        elif built.sharded:
            tied = bool(getattr(built.base_config, "tie_word_embeddings", False))
            streamed = FullWeights(built.model, built.engine, tied)
            if not self.is_main:
                streamed.drain()

        def write_all() -> str:
            try:
                return str(
                    self._write_checkpoint(
                        progress, figures, engine_state, weight_of, rng, rank_state, full, streamed
                    )
                )
            finally:
                if streamed is not None:  # a failed write still completes every rank's gathers
                    streamed.drain()

        path = self._on_main(f"checkpoint {step}", write_all)
        progress.last_saved, progress.last_checkpoint = step, path
        if self.is_main:
            self.emit(CheckpointSaved(step, path, figures))
            for c in prune_checkpoints(self.out, self.spec.keep_checkpoints):
                self.emit(CheckpointRemoved(c.step, str(c.path)))

    def _write_checkpoint(
        self,
        progress: Progress,
        figures: dict[str, Any],
        engine_state: dict[str, Any],
        weight_of: Callable[[str], torch.Tensor],
        rng: dict[str, Any],
        rank_state: dict[str, Any],
        full: dict[str, torch.Tensor] | None = None,
        streamed: FullWeights | None = None,
    ) -> Path:
        """Phase 2 (rank 0, or the single process): the checkpoint directory, with every shard in it."""
        dist, step = self.dist, progress.step
        tstate = self._training_state(progress, engine_state, rng)

        def write(tmp: Path) -> None:
            adapter = self._write_model(tmp, engine_state, weight_of, full, streamed)
            self._write_card(tmp, figures, adapter=False)
            if adapter is not None:
                self._write_adapter(tmp, adapter, figures)
            save_training_state(tmp, tstate)
            if dist is not None:
                self._move_shards_in(tmp, step, rank_state)

        try:
            return write_atomic_dir(self.out / checkpoint_name(step), write, self._manifest(step, figures))
        finally:
            if dist is not None:  # shards not moved in (a failed write) are of no use
                self._drop_staged(step)

    def _training_state(
        self, progress: Progress, engine_state: dict[str, Any], rng: dict[str, Any]
    ) -> dict[str, Any]:
        """The training state file's contents: the loop's progress, and the engine's state or where it is."""
        built, data, dist = self.built, self.data, self.dist
        tstate: dict[str, Any] = {
            "version": STATE_VERSION,
            "step": progress.step,
            "hyperparameters": data.hp.model_dump(),
            "method": data.job.method.model_dump(mode="json"),
            "rng": rng,
            "losses": progress.losses[-LOSS_WINDOW:],
            "trained_tokens": progress.trained_tokens,
            "valid_loss": progress.valid_loss,
        }
        if dist is None:
            tstate["engine"] = engine_state
        else:
            tstate["world_size"] = dist.world_size  # the engine state is in the per-rank shard files
            if built.sharded:  # ... its rows in DCP's folder
                tstate["engine_dcp"] = ENGINE_DCP
                tstate["engine_header"] = {k: v for k, v in engine_state.items() if k != "mode_state"}
        return tstate

    def _write_model(
        self,
        tmp: Path,
        engine_state: dict[str, Any],
        weight_of: Callable[[str], torch.Tensor],
        full: dict[str, torch.Tensor] | None,
        streamed: FullWeights | None,
    ) -> dict[str, torch.Tensor] | None:
        """The model's files into ``tmp``, from wherever this run's weights are; the LoRA adapter's state
        to save beside them (None for a full fine-tune)."""
        built, data = self.built, self.data
        adapter = None
        if streamed is not None:
            save_model_files(
                tmp,
                streamed.refs,
                built.base_config,
                data.tokenizer,
                built.generation_config,
                fetch=streamed.fetch,
                names=streamed.names,
            )
        elif full is not None:  # sharded: the gathered state (LoRA: the adapter's, merged for the model)
            adapter = full if self.spec.lora is not None else None
            weights = merged_lora_state(built.model, full) if adapter is not None else full
            save_model_files(tmp, weights, built.base_config, data.tokenizer, built.generation_config)
        elif self.spec.lora is None:
            refs, fetch = self._streamed_export(set(engine_state["mode_state"]["device_params"]), weight_of)
            save_model_files(
                tmp, refs, built.base_config, data.tokenizer, built.generation_config, fetch=fetch
            )
        else:
            weights, adapter = self._export()
            save_model_files(tmp, weights, built.base_config, data.tokenizer, built.generation_config)
        return adapter

    def _write_adapter(self, tmp: Path, adapter: dict[str, torch.Tensor], figures: dict[str, Any]) -> None:
        # Explicit save_embedding_layers (never "auto": no Hub lookup of the base config): the
        # embeddings go into the adapter only when the vocabulary grew, so that the adapter
        # works with the tokens it was trained with on a base model resized to the tokenizer.
        self.built.model.save_pretrained(
            str(tmp / "adapter"), state_dict=adapter, save_embedding_layers=self.built.added_tokens > 0
        )
        self._write_card(tmp / "adapter", figures, adapter=True)  # over peft's empty template

    def _move_shards_in(self, tmp: Path, step: int, rank_state: dict[str, Any]) -> None:
        """Rank 0's shard written, the other ranks' staged shards (and DCP's folder) moved into ``tmp``."""
        assert self.dist is not None
        world_size = self.dist.world_size
        save_rank_state(tmp / engine_shard_name(0, world_size), rank_state)
        for r in range(1, world_size):
            staged, name = self._staged(step, r), engine_shard_name(r, world_size)
            os.replace(tensors_path(staged), tensors_path(tmp / name))
            os.replace(staged, tmp / name)
        if self.built.sharded:
            os.replace(self._staged_dcp(step), tmp / ENGINE_DCP)

    def _manifest(self, step: int, figures: dict[str, Any]) -> dict[str, Any]:
        manifest: dict[str, Any] = {
            "kind": "checkpoint",
            "step": step,
            "base_model": self.spec.model,
            "metrics": figures,
            MANIFEST_ENGINE: {
                "mode": self.built.engine.mode,
                "accumulate_on": self.data.job.engine.accumulate_on,
            },
        }
        if self.dist is not None:
            manifest["world_size"] = self.dist.world_size
        return manifest

    def _drop_staged(self, step: int) -> None:
        """The other ranks' staged shards and DCP's folder, removed where still there."""
        assert self.dist is not None
        for r in range(1, self.dist.world_size):
            self._staged(step, r).unlink(missing_ok=True)
            tensors_path(self._staged(step, r)).unlink(missing_ok=True)
        shutil.rmtree(self._staged_dcp(step), ignore_errors=True)

    def _write_card(self, folder: Path, figures: dict[str, Any], *, adapter: bool) -> None:
        """The folder's README.md: trainer.run.model_card (base, data sizes, hyperparameters, losses)."""
        hp = self.data.hp
        card = model_card(
            self.spec,
            adapter=adapter,
            hyperparameters=hp.model_dump(mode="json"),
            figures=figures,
            train_examples=len(self.data.train),
            valid_examples=len(self.data.valid),
            total_steps=hp.total_steps,
        )
        (folder / CARD_FILE).write_text(card, encoding="utf-8")

    def export_final(self, progress: Progress) -> Path:
        """``final/``: the last checkpoint's model files (hard links where possible), no training state
        or engine shards; written by rank 0, its path returned on every rank."""
        assert progress.last_checkpoint is not None
        src = Path(progress.last_checkpoint)

        def write(tmp: Path) -> None:
            for p in sorted(src.rglob("*")):
                skip = (TRAINING_STATE, tensors_path(Path(TRAINING_STATE)).name, MANIFEST)
                rel = p.relative_to(src)
                if (
                    p.is_file()
                    and p.name not in skip
                    and not is_engine_shard(p.name)
                    and rel.parts[0] != ENGINE_DCP
                ):
                    link_or_copy(p, tmp / rel)

        def export() -> str:
            return str(
                write_atomic_dir(
                    self.out / FINAL_DIR,
                    write,
                    {
                        "kind": "final",
                        "step": progress.step,
                        "base_model": self.spec.model,
                        "metrics": metrics(progress),
                    },
                )
            )

        return Path(self._on_main("the final model", export))

    def write_result(self, result: dict[str, Any]) -> None:
        """``result.json`` (rank 0); every rank raises when it could not be written."""
        self._on_main(RESULT_FILE, lambda: write_json_atomic(self.out / RESULT_FILE, result))
