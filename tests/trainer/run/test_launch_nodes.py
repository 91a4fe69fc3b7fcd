"""trainer.run.launch across nodes: two launches of one node each (two processes, as two worker hosts
would run them, here on the loopback), meeting at one c10d rendezvous, train the job as one group of
2 ranks: the same weights as one launch of 2 ranks on one node."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.trainer.run.test_cli_nproc import _spec
from trainer.run.launch import NodeRanks, RankExit, free_port

ROOT = Path(__file__).resolve().parents[3]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(
        OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false"
    )
    return env


def _train_cmd(spec: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "trainer", "train", str(spec), "--output-dir", str(out), "--no-progress"]


NODE = """
import json, sys
from trainer.run.launch import NodeRanks
cmd, port, env = json.loads(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
with NodeRanks(cmd, nproc_per_node=1, nnodes=2, rdzv_endpoint=f"127.0.0.1:{port}", local_addr="127.0.0.1",
                run_id="two-nodes", devices=None, env=env, term_grace=5) as node:
    end = node.start().wait()
print(json.dumps([end.code, end.rank]), flush=True)
"""


@pytest.mark.slow
@pytest.mark.services  # job processes
@pytest.mark.timeout(900)
def test_two_nodes_of_one_rank_equal_one_node_of_two(tmp_path: Path) -> None:
    import json

    import torch
    from safetensors.torch import load_file

    spec = _spec(tmp_path)
    one = tmp_path / "one-node"
    with NodeRanks(
        _train_cmd(spec, one), nproc_per_node=2, run_id="one-node", devices=None, env=_env()
    ) as node:
        assert node.start().wait() == RankExit(0)

    two = tmp_path / "two-nodes"
    port = str(free_port())
    args = [json.dumps(_train_cmd(spec, two)), port, json.dumps(_env())]
    nodes = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(NODE), *args],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [n.communicate(timeout=600) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], [o[1][-3000:] for o in outs]
    assert [json.loads(o[0].strip().splitlines()[-1]) for o in outs] == [[0, None], [0, None]]
    shards = sorted(p.name for p in (two / "checkpoint-000004").glob("engine-rank*.pt"))
    assert shards == ["engine-rank00000-of-00002.pt", "engine-rank00001-of-00002.pt"]  # one group of 2

    a = load_file(str(one / "final" / "model.safetensors"))
    b = load_file(str(two / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(b[k].float(), a[k].float(), rtol=0, atol=1e-5, msg=k)


FAILING_NODE = """
import json, sys
from trainer.run.launch import NodeRanks
port, d, env = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
rank = '''
import os, sys, time
from pathlib import Path
d, r = Path(sys.argv[1]), os.environ["RANK"]
(d / f"up-{r}").write_text(str(os.getpid()))
if r == "1":
    while not (d / "up-0").exists(): time.sleep(0.01)
    sys.exit(3)
time.sleep(120)
'''
with NodeRanks([sys.executable, "-c", rank, d], nproc_per_node=1, nnodes=2, rdzv_endpoint=f"127.0.0.1:{port}",
                local_addr="127.0.0.1", run_id="failing", devices=None, env=env, term_grace=5) as node:
    end = node.start().wait()
print(json.dumps([end.code, end.rank]), flush=True)
"""


@pytest.mark.slow  # 20-45 s here: two agents' start-up
@pytest.mark.services  # agent processes
@pytest.mark.timeout(300)
def test_a_failing_node_stops_the_other_nodes(tmp_path: Path) -> None:
    """Rank 1 (node B) exits 3: B's launch says so; node A, whose agent sees only its own healthy rank,
    stops it on B's word in the rendezvous store and ends with the peer-lost code (76), well before its
    rank's own end (120 s)."""
    import json
    import time

    from tests.trainer.run.test_launch import alive
    from trainer.run.launch import EXIT_PEER_LOST

    port = str(free_port())
    t0 = time.monotonic()
    nodes = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(FAILING_NODE), port, str(tmp_path), json.dumps(_env())],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [n.communicate(timeout=240) for n in nodes]
    assert time.monotonic() - t0 < 110, [o[1][-2000:] for o in outs]
    ends = sorted(json.loads(o[0].strip().splitlines()[-1]) for o in outs)
    assert ends == [[3, 1], [EXIT_PEER_LOST, None]], [o[1][-2000:] for o in outs]
    assert not alive(int((tmp_path / "up-0").read_text()))
