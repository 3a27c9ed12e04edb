"""``python -m xmc_engine`` is the ``xmc-engine`` command."""

import sys

from xmc_engine.cli import main

sys.exit(main())
