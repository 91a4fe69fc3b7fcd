"""``python -m demo`` (``make run``): see :mod:`demo`."""

import sys

from demo.cli import main

sys.exit(main())
