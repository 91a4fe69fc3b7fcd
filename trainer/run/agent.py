"""The agent process of one node's ranks: ``python -m trainer.run.agent CONFIG.json``.

Started by :class:`trainer.run.launch.Ranks` (never run by hand): it runs torch's elastic agent
(``elastic_launch``, the one ``torchrun`` runs) with a c10d rendezvous and no restarts, starting each
rank as ``python -m trainer.run.rank_entry CMD...``, and writes how the ranks ended to the config's
``result`` file as ``{"code": C, "rank": R}``: 0; the first failing rank's code (the agent has stopped
the others: SIGTERM, SIGKILL after ``term_grace``); or the signal that stopped the agent itself
(``rank`` null; the agent tore its ranks down with it). SIGUSR1 (SIGUSR2) makes it send SIGTERM
(SIGINT) to its ranks, which then exit with their own codes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from trainer.run.launch import (
    AGENT_PID_ENV,
    EXIT_PEER_LOST,
    FORWARD_SIGNALS,
    RANK_DIR_ENV,
    AgentConfig,
    read_pids,
)


def _forward(sig: int) -> None:
    """Send ``sig`` to this agent's ranks (the pids the wrapper recorded that are still our children)."""
    me = os.getpid()
    for pid in read_pids(os.environ[RANK_DIR_ENV]).values():
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == me:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)


def _forwarder(sig: int) -> Callable[[int, FrameType | None], None]:
    return lambda _signum, _frame: _forward(sig)


def first_failure(failures: dict[int, Any]) -> tuple[int, int]:
    """(rank, exit code) of the failure the group's code is: the first the agent saw (its order), a
    rank's own failure before a peer-lost exit seen in the same round."""
    ranks = list(failures)
    own = [r for r in ranks if failures[r].exitcode != EXIT_PEER_LOST]
    rank = (own or ranks)[0]
    return rank, int(failures[rank].exitcode)


def run(cfg: AgentConfig) -> dict[str, Any]:
    """Run the agent to the end; the result to write."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    rdzv: dict[str, Any] = {"timeout": cfg.rdzv_timeout}
    if cfg.rdzv_host is not None:
        rdzv["is_host"] = cfg.rdzv_host
    config = LaunchConfig(
        min_nodes=cfg.nnodes,
        max_nodes=cfg.nnodes,
        nproc_per_node=cfg.nproc_per_node,
        run_id=cfg.run_id,
        rdzv_backend="c10d",
        rdzv_endpoint=cfg.rdzv_endpoint,
        rdzv_configs=rdzv,
        max_restarts=0,
        monitor_interval=cfg.monitor_interval,
        logs_specs=DefaultLogsSpecs(log_dir=cfg.log_dir),
        local_addr=cfg.local_addr,
        virtual_local_rank=cfg.gpus,  # each GPU rank sees only its GPU of CUDA_VISIBLE_DEVICES
        shutdown_timeout=cfg.term_grace,
    )
    try:
        elastic_launch(config, sys.executable)("-m", "trainer.run.rank_entry", *cfg.cmd)
    except ChildFailedError as e:
        rank, code = first_failure(e.failures)
        return {"code": code, "rank": rank}
    except SignalException as e:
        return {"code": -int(e.sigval), "rank": None}
    return {"code": 0, "rank": None}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    cfg = AgentConfig(**json.loads(Path(args[0]).read_text()))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    for to_ranks, ours in FORWARD_SIGNALS.items():
        signal.signal(ours, _forwarder(to_ranks))
    result = run(cfg)
    Path(cfg.result).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
