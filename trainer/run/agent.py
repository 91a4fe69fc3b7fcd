"""The agent process of one node's ranks: ``python -m trainer.run.agent CONFIG.json``.

Started by :class:`trainer.run.launch.NodeRanks` (never run by hand): it runs torch's elastic agent
(``elastic_launch``, the one ``torchrun`` runs) with a c10d rendezvous and no restarts, starting each
rank as ``python -m trainer.run.rank_entry CMD...``, and writes how the ranks ended to the config's
``result`` file as ``{"code": C, "rank": R}``: 0; the first failing rank's code (the agent has stopped
the others: SIGTERM, then SIGKILL after torch's fixed 30 s, which its process context applies when a
rank fails whatever the agent's ``shutdown_timeout``); or the signal that stopped the agent itself
(``rank`` null; the agent tore its ranks down with it). SIGUSR1 (SIGUSR2) makes it send SIGTERM
(SIGINT) to its ranks, which then exit with their own codes. A node of a multi-node launch also stops
its ranks when another node's failed (:class:`PeerWatch`; code 76, rank null).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
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


def _our_ranks_alive() -> bool:
    """Whether any rank of this agent still runs (a child of ours that is not a zombie)."""
    me = os.getpid()
    for pid in read_pids(os.environ[RANK_DIR_ENV]).values():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[1]) == me:
            return True
    return False


class PeerWatch:
    """One node of a multi-node job: the agents of the other nodes neither see this node's failure nor
    it theirs (each watches its own ranks only). A node whose ranks failed sets a key in the
    rendezvous store; every node's watch polls it while its ranks run, and a set key, or the store
    gone (its host node died), stops this node's ranks through the agent (SIGTERM to this process)."""

    def __init__(self, cfg: AgentConfig, interval: float = 1.0) -> None:
        host, _, port = cfg.rdzv_endpoint.rpartition(":")
        self.host, self.port, self.interval = host, int(port), interval
        self.key = f"zenflow/{cfg.run_id}/node_failed"
        self.tripped = threading.Event()
        self.done = threading.Event()
        self._store: Any = None

    def _connect(self) -> Any:
        from torch._C._distributed_c10d import TCPStore

        if self._store is None:
            self._store = TCPStore(self.host, self.port, is_master=False, timeout=timedelta(seconds=10))
        return self._store

    def start(self) -> PeerWatch:
        threading.Thread(target=self._run, name="zenflow-peer-watch", daemon=True).start()
        return self

    def _run(self) -> None:
        connected = False
        while not self.done.wait(self.interval):
            if not _our_ranks_alive():
                continue
            try:
                failed = self._connect().check([self.key])
                connected = True
            except Exception:  # not up yet; or, once connected, its host node is gone
                failed = connected
            if failed and not self.done.is_set() and _our_ranks_alive():
                logging.getLogger("zenflow.launch").error(
                    "another node of the job failed: stopping this node"
                )
                self.tripped.set()
                os.kill(os.getpid(), signal.SIGTERM)
                return

    def announce_failure(self) -> None:
        """Tell the other nodes that this node's ranks failed (best effort)."""
        self.done.set()
        with contextlib.suppress(Exception):
            self._connect().set(self.key, "1")


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
    watch = PeerWatch(cfg).start() if cfg.nnodes > 1 else None
    try:
        elastic_launch(config, sys.executable)("-m", "trainer.run.rank_entry", *cfg.cmd)
    except ChildFailedError as e:
        if watch is not None:
            watch.announce_failure()
        rank, code = first_failure(e.failures)
        return {"code": code, "rank": rank}
    except SignalException as e:
        if watch is not None and watch.tripped.is_set():
            return {"code": EXIT_PEER_LOST, "rank": None}
        return {"code": -int(e.sigval), "rank": None}
    except Exception:  # the rendezvous failed: a node never came, or its store's host node went away
        logging.getLogger("zenflow.launch").exception("the elastic agent failed")
        if watch is None:
            return {"code": 1, "rank": None}
        watch.announce_failure()
        started = bool(read_pids(os.environ[RANK_DIR_ENV]))  # then the agent has stopped them
        return {"code": EXIT_PEER_LOST if started else 1, "rank": None}
    finally:
        if watch is not None:
            watch.done.set()
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
