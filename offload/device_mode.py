"""``device`` mode: plain AdamW on the device, the memory-hungry baseline.

``torch.optim.AdamW(fused=True)`` over the trainable parameters (CPU and CUDA), told of a skipped
step through its ``found_inf`` (as ``torch.amp.GradScaler`` does), so a skipped step changes
nothing without a host sync. In a process group it is plain data parallelism (DDP's arithmetic): the
engine averages the gradients across ranks first and every rank runs the same update. bf16/fp16 parameters get an fp32 master copy on the device (mixed precision: the
optimizer updates the master, the model sees it rounded), so device optimizer state is 8 bytes per
parameter for fp32 models and 12 for bf16/fp16 ones. Loss-scaled fp16 gradients (:mod:`offload.guard`)
are unscaled and clipped in their fp32 copies, never in fp16.
"""

from __future__ import annotations

from typing import Any

import torch

from offload.collectives import EngineGroup
from offload.config import EngineConfig
from offload.device import DeviceOps
from offload.guard import Gate
from offload.memory import EngineMemory
from offload.mode_base import Mode, NamedParams, nbytes, to_cpu
from offload.timing import StepStats


class DeviceMode(Mode):
    name = "device"

    def __init__(
        self, named: NamedParams, cfg: EngineConfig, ops: DeviceOps, ranks: EngineGroup | None = None
    ) -> None:
        super().__init__(named, cfg, ops, ranks)
        self.masters: dict[str, torch.Tensor] = {}
        opt_params: list[torch.Tensor] = []
        for n, p in named:
            if p.dtype in (torch.bfloat16, torch.float16):
                m = p.detach().float().clone().requires_grad_(True)
                self.masters[n] = m
                opt_params.append(m)
            else:
                opt_params.append(p)
        self.opt = torch.optim.AdamW(
            opt_params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, fused=True
        )
        # torch creates the state on the first step, skipped or not; create it now, as torch would
        # (so a skipped first step leaves the state as it was, and its size is known from the start)
        for t in opt_params:
            self.opt.state[t] = {
                "step": torch.zeros((), dtype=torch.float32, device=t.device),
                "exp_avg": torch.zeros_like(t, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(t, memory_format=torch.preserve_format),
            }

    @torch.no_grad()
    def step(self, stats: StepStats, lr: float, gate: Gate) -> None:
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.found_inf = gate.bad_f  # type: ignore[attr-defined]  # read by the fused step
        low = [(p, self.masters[n]) for n, p in self.named if n in self.masters]
        scaled: list[torch.Tensor] = []  # fp32 copies of loss-scaled fp16 gradients (offload.guard)
        for p, m in low:
            m.grad = None if p.grad is None else p.grad.float()
            if m.grad is not None and gate.factor_for(p.dtype) is not None:
                scaled.append(m.grad)
        if scaled:
            assert gate.grad_factor is not None
            torch._foreach_mul_(scaled, gate.grad_factor)  # 1/scale and the clip, in fp32
        self.opt.step()
        if low:
            torch._foreach_copy_([p for p, _ in low], [m for _, m in low])
        for _, m in low:
            m.grad = None

    def memory(self) -> EngineMemory:
        state = {
            "exp_avg": 0,
            "exp_avg_sq": 0,
            "master": sum(nbytes(m) for m in self.masters.values()),
            "step": 0,
        }
        for st in self.opt.state.values():
            for key in ("exp_avg", "exp_avg_sq", "step"):
                t = st.get(key)
                state[key] += nbytes(t) if isinstance(t, torch.Tensor) else 0
        return EngineMemory(self.name, self.params(), device_state=state)

    def state_bytes(self) -> int:
        total = sum(m.numel() * m.element_size() for m in self.masters.values())
        for st in self.opt.state.values():
            for key in ("exp_avg", "exp_avg_sq", "step"):  # fused: the step count lives on the device
                t = st.get(key)
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
        return total

    def state_dict(self, copy: bool = True) -> dict[str, Any]:
        if not copy:  # the optimizer's state_dict() holds its state tensors themselves
            return {
                "mode": self.name,
                "device_params": self.device_params_state(copy=False),
                "masters": dict(self.masters),
                "optimizer": self.opt.state_dict(),
            }
        return {
            "mode": self.name,
            "device_params": self.device_params_state(),
            "masters": to_cpu(self.masters),
            # to_cpu copies every tensor and rebuilds the containers: no device-side deep copy first
            "optimizer": to_cpu(self.opt.state_dict()),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.load_device_params(sd["device_params"])
        with torch.no_grad():
            for n, m in self.masters.items():
                m.copy_(sd["masters"][n])
        self.opt.load_state_dict(sd["optimizer"])
