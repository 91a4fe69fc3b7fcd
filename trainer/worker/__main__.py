"""``python -m trainer.worker``: see :mod:`trainer.worker.launcher`."""

import sys

from trainer.worker.launcher import main

sys.exit(main())
