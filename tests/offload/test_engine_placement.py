"""Core placement (offload.placement) on faked sysfs topologies, and the engine applying it here."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from offload.config import EngineConfig
from offload.engine import ZenFlowEngine
from offload.placement import Placement, format_cpulist, parse_cpulist, plan, read_topology


def _sysfs(
    root: Path,
    cores: list[tuple[int, ...]],
    nodes: dict[int, list[int]] | None = None,
    gpus: list[tuple[str, int]] = (),
    others: list[str] = (),
) -> Path:
    """A sysfs tree: ``cores`` as sibling groups, NUMA ``nodes``, NVIDIA ``gpus`` (address, node)."""
    cpu = root / "devices/system/cpu"
    online = sorted(c for core in cores for c in core)
    cpu.mkdir(parents=True)
    (cpu / "online").write_text(format_cpulist(online) + "\n")
    for core in cores:
        for c in core:
            t = cpu / f"cpu{c}/topology"
            t.mkdir(parents=True)
            (t / "thread_siblings_list").write_text(format_cpulist(core) + "\n")
    for n, cpus in (nodes or {}).items():
        d = root / f"devices/system/node/node{n}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(format_cpulist(cpus) + "\n")
    for addr, node in gpus:
        d = root / "bus/pci/devices" / addr
        d.mkdir(parents=True)
        (d / "vendor").write_text("0x10de\n")
        (d / "class").write_text("0x030200\n")
        (d / "numa_node").write_text(f"{node}\n")
    for addr in others:  # a NIC: not a GPU
        d = root / "bus/pci/devices" / addr
        d.mkdir(parents=True)
        (d / "vendor").write_text("0x15b3\n")
        (d / "class").write_text("0x020000\n")
    return root


def _smt_host(root: Path, gpus: list[tuple[str, int]] = ()) -> Path:
    """2 sockets x 8 cores x 2 hyperthreads: core i has CPUs i and i + 16; node 0 = cores 0-7."""
    cores = [(i, i + 16) for i in range(16)]
    nodes = {0: [*range(0, 8), *range(16, 24)], 1: [*range(8, 16), *range(24, 32)]}
    return _sysfs(root, cores, nodes, gpus, others=["0000:5e:00.0"])


def _check_split(p: Placement, siblings: dict[int, tuple[int, ...]]) -> None:
    assert p.placed
    assert not set(p.training) & set(p.optimizer)
    assert set(p.training) | set(p.optimizer) == set(p.process)
    for side in (p.training, p.optimizer):
        for c in side:  # a hyperthread is always with its sibling
            assert set(siblings[c]) <= set(side)


def test_cpulist_round_trip() -> None:
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert format_cpulist([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"
    assert parse_cpulist("") == []


def test_topology_reads_siblings_nodes_and_gpus(tmp_path: Path) -> None:
    topo = read_topology(_smt_host(tmp_path, gpus=[("0000:b1:00.0", 1), ("0000:3b:00.0", 0)]))
    assert len(topo.cores) == 16 and topo.cores[0] == (0, 16) and topo.cores[8] == (8, 24)
    assert topo.node_of[24] == 1 and topo.node_of[3] == 0
    assert topo.gpus == (("0000:3b:00.0", 0), ("0000:b1:00.0", 1))  # PCI bus order; the NIC is not one


def test_a_single_process_splits_physical_cores_with_siblings_together(tmp_path: Path) -> None:
    topo = read_topology(_smt_host(tmp_path))
    siblings = {c: core for core in topo.cores for c in core}
    for ratio, opt_cores in ((0.5, 8), (0.25, 4), (0.01, 1), (1.0, 15)):
        p = plan(topo, topo.online, ratio)
        _check_split(p, siblings)
        assert len(p.optimizer) == 2 * opt_cores and len(p.training) == 32 - 2 * opt_cores
        assert p.gpu_slot is None


def test_each_gpu_process_gets_a_disjoint_numa_local_share(tmp_path: Path) -> None:
    gpus = [("0000:1a:00.0", 0), ("0000:3b:00.0", 0), ("0000:86:00.0", 1), ("0000:af:00.0", 1)]
    topo = read_topology(_smt_host(tmp_path, gpus))
    siblings = {c: core for core in topo.cores for c in core}
    shares = []
    for slot, (addr, node) in enumerate(gpus):
        p = plan(topo, topo.online, 0.5, gpu=addr)
        _check_split(p, siblings)
        assert p.gpu_slot == slot and p.gpus == 4 and p.numa_node == node
        assert {topo.node_of[c] for c in p.process} == {node}  # NUMA-local
        assert len(p.process) == 8 and len(p.optimizer) == 4  # 4 physical cores each, 2 for the optimizer
        shares.append(set(p.process))
    for i in range(4):
        for j in range(i + 1, 4):
            assert not shares[i] & shares[j]
    assert set().union(*shares) == set(topo.online)


def test_gpus_without_numa_information_split_all_cores_by_slot(tmp_path: Path) -> None:
    cores = [(i,) for i in range(12)]
    topo = read_topology(
        _sysfs(tmp_path, cores, gpus=[("0000:01:00.0", -1), ("0000:02:00.0", -1), ("0000:03:00.0", -1)])
    )
    got = [plan(topo, topo.online, 0.5, gpu=f"0000:0{i + 1}:00.0") for i in range(3)]
    assert [g.process for g in got] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)]
    assert all(g.numa_node is None and g.placed for g in got)


def test_a_process_restricted_already_keeps_its_cpus(tmp_path: Path) -> None:
    topo = read_topology(_smt_host(tmp_path, gpus=[("0000:3b:00.0", 0), ("0000:b1:00.0", 1)]))
    allowed = {4, 5, 20, 21}  # e.g. a container's cpuset
    p = plan(topo, allowed, 0.5, gpu="0000:b1:00.0")
    assert p.gpu_slot is None and "already restricted" in p.note
    assert set(p.process) == allowed and p.training == (4, 20) and p.optimizer == (5, 21)


def test_where_no_split_is_possible_it_says_why(tmp_path: Path) -> None:
    one_core = read_topology(_sysfs(tmp_path / "a", [(0, 1)]))
    p = plan(one_core, one_core.online, 0.5)
    assert not p.placed and "one physical core" in p.note and p.process == (0, 1)
    crowded = read_topology(
        _sysfs(tmp_path / "b", [(0,), (1,)], {0: [0, 1]}, gpus=[(f"0000:0{i}:00.0", 0) for i in range(1, 4)])
    )
    p = plan(crowded, crowded.online, 0.5, gpu="0000:01:00.0")  # 3 GPUs share 2 cores: none for it
    assert not p.placed and "no physical core left" in p.note
    assert "placement off" in p.describe()


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs CPU affinity and two CPUs",
)
def test_the_engine_pins_worker_and_training_apart_and_restores() -> None:
    before = os.sched_getaffinity(0)
    with ZenFlowEngine(torch.nn.Linear(8, 8), EngineConfig(mode="zenflow")) as eng:
        p = eng.placement
        assert p.placed and p.applied, p.note
        worker = eng._mode.cpu_thread
        assert os.sched_getaffinity(worker.native_id) == set(p.optimizer)
        assert os.sched_getaffinity(0) == set(p.training) and not set(p.training) & set(p.optimizer)
        assert eng.cpu_split == (len(p.training), len(p.optimizer))
        started = threading.Thread(target=lambda: None)  # a thread started meanwhile inherits the pin
        started.start()
        started.join()
        d = p.as_dict()
        assert d["placed"] and d["training_cpus"] == format_cpulist(p.training)
    assert os.sched_getaffinity(0) == before
    with ZenFlowEngine(torch.nn.Linear(8, 8), EngineConfig(mode="zenflow", bind_worker_cores=False)) as eng:
        assert not eng.placement.placed and "off" in eng.placement.note
        assert os.sched_getaffinity(eng._mode.cpu_thread.native_id) == before
        assert os.sched_getaffinity(0) == before
    with ZenFlowEngine(torch.nn.Linear(8, 8), EngineConfig(mode="device")) as eng:
        assert not eng.placement.placed and os.sched_getaffinity(0) == before


def test_descriptions_say_what_was_placed(tmp_path: Path) -> None:
    gpus = [("0000:1a:00.0", 0), ("0000:86:00.0", 1)]
    topo = read_topology(_smt_host(tmp_path, gpus))
    p = plan(topo, topo.online, 0.5, gpu="0000:86:00.0")
    assert p.describe().startswith(
        "CPU placement (GPU 2 of 2, NUMA node 1): training thread on CPUs 8-11,24-27"
    )
    share_only = Placement(process=p.process, gpu_slot=1, gpus=2, numa_node=1, note="mode device has none")
    assert (
        share_only.describe()
        == "CPU placement (GPU 2 of 2, NUMA node 1): this process on CPUs 8-15,24-31 (mode device has none)"
    )
    assert (
        Placement(note="bind_worker_cores is off").describe() == "CPU placement off: bind_worker_cores is off"
    )
