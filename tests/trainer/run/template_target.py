"""A module the process template's tests run (``python -m tests.trainer.run.template_target MODE ...``):
it reports what it sees as one JSON line, then ``exit CODE``, ``gather DIR CODE`` (exit CODE once every
local rank has reported: a file each in DIR), ``term`` (exit 75 on SIGTERM), ``kill`` (SIGKILL itself) or
``sleep``."""

import json
import os
import signal
import sys
import time

mode = sys.argv[1]
if mode == "term":  # before the report: the test sends SIGTERM as soon as it has read it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))
print(
    json.dumps(
        {
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "argv": sys.argv,
            "env": os.environ.get("ZENFLOW_TEMPLATE_PROBE"),
            "rank": os.environ.get("RANK"),
            "agent": os.environ.get("ZENFLOW_AGENT_PID"),
            "cwd": os.getcwd(),
            "main": __name__,
            "torch_threads": sys.modules["torch"].get_num_threads() if "torch" in sys.modules else None,
        }
    ),
    flush=True,
)
if mode == "exit":
    sys.exit(int(sys.argv[2]))
if mode == "gather":  # a rank that fails first takes the others down: exit once all have reported
    folder = sys.argv[2]
    open(os.path.join(folder, os.environ.get("LOCAL_RANK", "0")), "w").close()
    deadline = time.monotonic() + 300
    while (
        len(os.listdir(folder)) < int(os.environ.get("LOCAL_WORLD_SIZE", "1")) and time.monotonic() < deadline
    ):
        time.sleep(0.05)
    sys.exit(int(sys.argv[3]))
if mode == "term":
    time.sleep(120)
if mode == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "sleep":
    time.sleep(120)
