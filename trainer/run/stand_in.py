"""``python -m trainer.run.stand_in CMD...``: run ``CMD`` forked from the process template named in the
environment, this process standing in for it (:func:`trainer.run.template.run_forked`: signals passed
on, its end relayed), or exec ``CMD`` where no template serves it. How :class:`trainer.run.launch.NodeRanks`
starts a node's agent on a worker with a template. Imports no torch."""

from __future__ import annotations

import os
import sys

from trainer.run.template import run_forked


def main(argv: list[str] | None = None) -> int:
    cmd = sys.argv[1:] if argv is None else argv
    if not cmd:
        print("usage: python -m trainer.run.stand_in CMD...", file=sys.stderr)
        return 2
    run_forked(cmd, os.environ)
    os.execv(cmd[0], cmd)  # no process template serves this command
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
