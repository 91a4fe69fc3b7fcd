"""What the training run writes: resumable checkpoints (exported weights, LoRA adapter, the engine's
state, RNG states, the run's progress) and the ``final/`` model, both through
:func:`trainer.checkpoint.write_atomic_dir`.

Exported weights come from ``engine.consolidated_state_dict()``; for LoRA the merged model is written
plus ``adapter/``. Older checkpoints beyond ``keep_checkpoints`` are pruned after each save.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.checkpoint import (
    FINAL_DIR,
    MANIFEST,
    TRAINING_STATE,
    checkpoint_name,
    link_or_copy,
    prune_checkpoints,
    rng_state,
    save_model_files,
    save_training_state,
    write_atomic_dir,
)
from trainer.events import CheckpointRemoved, CheckpointSaved, Event
from trainer.lora import current_state, merged_lora_state
from trainer.run_setup import Built, Progress, RunData
from trainer.spec import JobSpec

if TYPE_CHECKING:
    import torch

STATE_VERSION = 1
#: Steps averaged for TrainResult.train_loss.
LOSS_WINDOW = 20


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
    """Writes the checkpoints and the final model of one run into ``out``."""

    def __init__(self, spec: JobSpec, out: Path, data: RunData, built: Built, emit: Callable[[Event], None]) -> None:
        self.spec, self.out, self.data, self.built, self.emit = spec, out, data, built, emit

    def _export(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
        """(model weights to write, LoRA adapter weights or None)."""
        model = self.built.model
        state = current_state(model, self.built.engine.consolidated_state_dict())
        if self.spec.lora is None:
            return state, None
        return merged_lora_state(model, state), state

    def save_checkpoint(self, progress: Progress) -> None:
        """Write a checkpoint at ``progress.step``, record it in ``progress``, prune older ones."""
        built, data = self.built, self.data
        weights, adapter = self._export()
        tstate = {
            "version": STATE_VERSION,
            "step": progress.step,
            "hyperparameters": data.hp.model_dump(),
            "engine": built.engine.state_dict(),
            "rng": rng_state(),
            "losses": progress.losses[-LOSS_WINDOW:],
            "trained_tokens": progress.trained_tokens,
            "valid_loss": progress.valid_loss,
        }
        figures = metrics(progress)

        def write(tmp: Path) -> None:
            save_model_files(tmp, weights, built.base_config, data.tokenizer, built.generation_config)
            if adapter is not None:
                # Explicit save_embedding_layers (never "auto": no Hub lookup of the base config): the
                # embeddings go into the adapter only when the vocabulary grew, so that the adapter
                # works with the tokens it was trained with on a base model resized to the tokenizer.
                built.model.save_pretrained(str(tmp / "adapter"), state_dict=adapter,
                                            save_embedding_layers=built.added_tokens > 0)
            save_training_state(tmp, tstate)

        path = write_atomic_dir(
            self.out / checkpoint_name(progress.step),
            write,
            {"kind": "checkpoint", "step": progress.step, "base_model": self.spec.model, "metrics": figures},
        )
        progress.last_saved, progress.last_checkpoint = progress.step, str(path)
        self.emit(CheckpointSaved(progress.step, str(path), figures))
        for c in prune_checkpoints(self.out, self.spec.keep_checkpoints):
            self.emit(CheckpointRemoved(c.step, str(c.path)))

    def export_final(self, progress: Progress) -> Path:
        """``final/``: the last checkpoint's model files (hard links where possible), no training state."""
        assert progress.last_checkpoint is not None
        src = Path(progress.last_checkpoint)

        def write(tmp: Path) -> None:
            for p in sorted(src.rglob("*")):
                if p.is_file() and p.name not in (TRAINING_STATE, MANIFEST):
                    link_or_copy(p, tmp / p.relative_to(src))

        return write_atomic_dir(
            self.out / FINAL_DIR,
            write,
            {"kind": "final", "step": progress.step, "base_model": self.spec.model, "metrics": metrics(progress)},
        )
