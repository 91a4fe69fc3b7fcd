"""A module the process template's tests run (``python -m tests.trainer.run.template_target MODE ...``):
it reports what it sees as one JSON line, then ``exit CODE``, ``term`` (exit 75 on SIGTERM), ``kill``
(SIGKILL itself) or ``sleep``."""

import json
import os
import signal
import sys
import time

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
mode = sys.argv[1]
if mode == "exit":
    sys.exit(int(sys.argv[2]))
if mode == "term":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))
    time.sleep(120)
if mode == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "sleep":
    time.sleep(120)
