"""``python -m trainer train SPEC.yaml`` (the same command as ``zenflow train``)."""

import sys

from trainer.cli import main

sys.exit(main())
