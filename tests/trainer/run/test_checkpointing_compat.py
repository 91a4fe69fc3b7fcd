"""Activation checkpointing is switched on under the transformers release's own name (the GPU image's
5.17 lacks ``activation_checkpointing_enable``; a bench run there failed on it)."""

from __future__ import annotations

from typing import Any

from trainer.run.setup import enable_activation_checkpointing


class _Old:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: Any = None) -> None:
        self.calls.append(("gradient", gradient_checkpointing_kwargs))


class _New(_Old):
    def activation_checkpointing_enable(self, activation_checkpointing_kwargs: Any = None) -> None:
        self.calls.append(("activation", activation_checkpointing_kwargs))


def test_old_transformers_name_is_used_when_the_new_one_is_missing() -> None:
    m = _Old()
    enable_activation_checkpointing(m)
    assert m.calls == [("gradient", {"use_reentrant": False})]


def test_new_name_is_preferred_when_present() -> None:
    m = _New()
    enable_activation_checkpointing(m)
    assert m.calls == [("activation", {"use_reentrant": False})]
