"""Streamed state files (offload.state_io) and the engine's state without copies (state_views)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from offload.config import EngineConfig
from offload.engine import ZenFlowEngine
from offload.state_io import join_tensors, read_safetensors, split_tensors, write_safetensors
from tests.offload.test_engine import _mlp, _train_step, _zen_cfg


def test_write_is_the_views_bytes_and_safetensors_reads_it(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(10_000, generator=g)
    tensors = {
        "view": big[100:164],  # a view of a larger storage: only its own bytes are written
        "bf16": torch.randn(3, 5, generator=g).bfloat16(),
        "fp16": torch.randn(7, generator=g).half(),
        "ints": torch.arange(9, dtype=torch.int64).view(3, 3),
        "flags": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }
    path = tmp_path / "x.safetensors"
    n = write_safetensors(path, tensors, {"format": "pt"})
    payload = sum(t.numel() * t.element_size() for t in tensors.values())
    assert path.stat().st_size == n and n - payload < 1024  # header + data, no storage beyond a view
    ref = load_file(str(path))
    mapped = read_safetensors(path, clone_below=0)
    for k, t in tensors.items():
        assert ref[k].dtype == t.dtype and torch.equal(ref[k], t), k
        assert mapped[k].dtype == t.dtype and torch.equal(mapped[k], t), k


def test_fetch_writes_values_made_while_writing(tmp_path: Path) -> None:
    shapes = {"a": torch.empty(4, 3, device="meta"), "b": torch.empty(5, dtype=torch.bfloat16, device="meta")}
    asked: list[str] = []

    def fetch(name: str) -> torch.Tensor:
        asked.append(name)
        return torch.full(tuple(shapes[name].shape), float(len(name)), dtype=shapes[name].dtype)

    write_safetensors(tmp_path / "w.safetensors", shapes, fetch=fetch)
    got = load_file(str(tmp_path / "w.safetensors"))
    assert sorted(asked) == ["a", "b"] and torch.equal(got["b"], torch.ones(5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="changed"):
        write_safetensors(tmp_path / "bad.safetensors", shapes, fetch=lambda n: torch.zeros(1))


def test_split_and_join_keep_the_structure() -> None:
    t = torch.arange(4.0)
    state = {"a": [t, (1, t[:2])], "b": {"c": None, "d": 3.5}, "e": "x"}
    skeleton, tensors = split_tensors(state)
    assert len(tensors) == 2 and tensors["/a/0"] is t
    back = join_tensors(skeleton, tensors)
    assert back["a"][1][0] == 1 and isinstance(back["a"][1], tuple) and back["b"] == state["b"]
    assert torch.equal(back["a"][1][1], t[:2])


def _streamed(eng: ZenFlowEngine, tmp: Path) -> Path:
    state, _ = eng.state_views()
    skeleton, tensors = split_tensors(state)
    write_safetensors(tmp / "s.safetensors", tensors)
    torch.save(skeleton, tmp / "s.pt")
    return tmp


def _loaded(tmp: Path) -> dict[str, object]:
    skeleton = torch.load(tmp / "s.pt", weights_only=False)
    state: dict[str, object] = join_tensors(skeleton, read_safetensors(tmp / "s.safetensors", clone_below=0))
    return state


@pytest.mark.parametrize(
    "cfg",
    [
        _zen_cfg(update_interval=3, select_interval=3, full_warm_up_rounds=2),
        _zen_cfg(accumulate_on="device", full_warm_up_rounds=1),
        _zen_cfg(mode="device"),
        _zen_cfg(mode="offload"),
    ],
    ids=["zenflow", "zenflow-device-acc", "device", "offload"],
)
def test_streamed_state_continues_identically(cfg: EngineConfig, tmp_path: Path) -> None:
    total, cut = 17, 8  # mid-window, a CPU result pending
    model = _mlp()
    with ZenFlowEngine(model, cfg) as eng:
        for i in range(cut):
            _train_step(model, eng, i)
        copied = io.BytesIO()
        torch.save(eng.state_dict(), copied)
        _streamed(eng, tmp_path)
        for i in range(cut, total):
            _train_step(model, eng, i)
        eng.flush()
    for source in ("streamed", "copied"):
        restored = _mlp(seed=123)
        with ZenFlowEngine(restored, cfg) as eng2:
            copied.seek(0)
            eng2.load_state_dict(_loaded(tmp_path) if source == "streamed" else torch.load(copied))
            for i in range(cut, total):
                _train_step(restored, eng2, i)
            eng2.flush()
        for a, b in zip(restored.parameters(), model.parameters(), strict=True):
            assert torch.equal(a, b), source


@pytest.mark.parametrize("mode", ["zenflow", "offload"])
def test_state_views_are_the_engines_own_host_buffers(mode: str) -> None:
    model = _mlp()
    cfg = _zen_cfg() if mode == "zenflow" else _zen_cfg(mode="offload")
    with ZenFlowEngine(model, cfg) as eng:
        for i in range(3):
            _train_step(model, eng, i)
        views, _ = eng.state_views()
        copies = eng.state_dict()
        host = views["mode_state"]["host"]
        assert host and all(eng.is_host_memory(h["master"]) for h in host)
        assert not any(eng.is_host_memory(h["master"]) for h in copies["mode_state"]["host"])
        params = dict(model.named_parameters())
        assert all(
            t is not None and t.data_ptr() == params[n].data_ptr()
            for n, t in views["mode_state"]["device_params"].items()
        )


def test_consolidated_one_equals_consolidated_state_dict_every_step() -> None:
    model = _mlp()
    with ZenFlowEngine(model, _zen_cfg(update_interval=3, select_interval=3)) as eng:
        pending_seen = False
        for i in range(10):
            _train_step(model, eng, i)
            whole = eng.consolidated_state_dict()
            _, weight_of = eng.state_views()
            pending_seen |= any(not torch.equal(whole[n], p.detach()) for n, p in model.named_parameters())
            for n, t in whole.items():
                assert torch.equal(weight_of(n), t), (i, n)
        assert pending_seen  # some step had a CPU result not merged yet: the merge was exercised


def test_zenflow_state_views_hold_the_device_optimizers_own_tensors() -> None:
    """zenflow's device optimizer state (the selected columns' moments, the small weights' state) is not
    copied out whole for a streamed checkpoint: its views are the optimizer's own tensors, the writer
    copies one at a time (the plan counts no copy of it: trainer.plan.candidates.checkpoint_bytes)."""
    model = _mlp()
    with ZenFlowEngine(model, _zen_cfg()) as eng:
        for i in range(3):
            _train_step(model, eng, i)
        views, _ = eng.state_views()
        copies = eng.state_dict()
        dev = views["mode_state"]["device_optimizer"]
        assert dev
        owned = {
            t.untyped_storage().data_ptr()
            for state in eng._mode.dev._full.values()
            for t in (state.exp_avg, state.exp_avg_sq)
        } | {
            t.untyped_storage().data_ptr()
            for grp in eng._mode.dev._groups
            for t in (grp.exp_avg, grp.exp_avg_sq)
        }
        for name, state in dev.items():
            for key in ("exp_avg", "exp_avg_sq"):
                view, copy = state[key], copies["mode_state"]["device_optimizer"][name][key]
                assert view.untyped_storage().data_ptr() in owned, (name, key)
                assert copy.untyped_storage().data_ptr() not in owned and torch.equal(view.cpu(), copy)
