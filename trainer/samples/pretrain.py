"""Pretraining a small Llama from scratch on a byte stream: the one loop behind the demo's base
(trainer.samples.demo_base) and the benchmarks' (bench.pretrained).

Plain torch AdamW with a linear warm-up and a cosine decay, random windows of ``seq`` bytes, gradients
clipped at 1. Everything that decides the weights is the recipe, the data and the library versions:
the model is built and the windows drawn from ``recipe.seed`` inside a forked RNG, so the caller's
random state is untouched (the thread count, which also decides the bits, is the caller's to fix).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol


class Recipe(Protocol):
    """What the loop reads of a recipe (each caller's dataclass has these and its own extras)."""

    @property
    def hidden(self) -> int: ...
    @property
    def intermediate(self) -> int: ...
    @property
    def layers(self) -> int: ...
    @property
    def heads(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def seq(self) -> int: ...
    @property
    def batch(self) -> int: ...
    @property
    def steps(self) -> int: ...
    @property
    def lr(self) -> float: ...
    @property
    def warmup(self) -> int: ...
    @property
    def min_lr_ratio(self) -> float: ...
    @property
    def weight_decay(self) -> float: ...
    @property
    def seed(self) -> int: ...


def lr_at(recipe: Recipe, step: int) -> float:
    """Linear warm-up, then cosine down to ``min_lr_ratio`` of the peak."""
    if step < recipe.warmup:
        return recipe.lr * (step + 1) / recipe.warmup
    t = (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup)
    return recipe.lr * (recipe.min_lr_ratio + (1 - recipe.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def pretrain_llama(
    recipe: Recipe,
    train: Any,
    valid: Any,
    *,
    max_positions: int,
    valid_batches: int,
    log_points: int,
    digits: int,
    log: Callable[[str], None],
) -> tuple[Any, float, float, list[tuple[int, float]]]:
    """A ``LlamaForCausalLM`` with the byte vocabulary trained on ``train`` (1-D token ids); returns
    it with the loss on ``valid_batches`` fixed windows of ``valid`` before and after, and the train
    loss at ``log_points`` steps (rounded to ``digits``), each also logged."""
    import torch
    from transformers import LlamaForCausalLM

    from trainer.model.catalog import builtin_config

    cfg = builtin_config("tiny-llama")  # the byte vocabulary and the special tokens' ids
    cfg.hidden_size, cfg.intermediate_size = recipe.hidden, recipe.intermediate
    cfg.num_hidden_layers, cfg.num_attention_heads = recipe.layers, recipe.heads
    cfg.num_key_value_heads, cfg.max_position_embeddings = recipe.kv_heads, max_positions
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        model = LlamaForCausalLM(cfg)
        gen = torch.Generator().manual_seed(recipe.seed)
        opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)

        def batch(src: torch.Tensor, g: torch.Generator) -> torch.Tensor:
            starts = torch.randint(0, len(src) - recipe.seq - 1, (recipe.batch,), generator=g)
            return torch.stack([src[s : s + recipe.seq] for s in starts.tolist()])

        @torch.no_grad()
        def valid_loss() -> float:
            model.eval()
            g = torch.Generator().manual_seed(12345)
            losses = [
                float(model(input_ids=(x := batch(valid, g)), labels=x).loss) for _ in range(valid_batches)
            ]
            model.train()
            return sum(losses) / len(losses)

        first = valid_loss()
        curve: list[tuple[int, float]] = []
        for step in range(recipe.steps):
            for group in opt.param_groups:
                group["lr"] = lr_at(recipe, step)
            x = batch(train, gen)
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if (step + 1) % max(1, recipe.steps // log_points) == 0:
                curve.append((step + 1, round(float(loss.detach()), digits)))
                log(f"  pretrain step {step + 1}/{recipe.steps}: loss {curve[-1][1]}")
        last = valid_loss()
    return model, first, last, curve
