"""``python -m worker``: see :mod:`worker.launcher`."""

import sys

from worker.launcher import main

sys.exit(main())
