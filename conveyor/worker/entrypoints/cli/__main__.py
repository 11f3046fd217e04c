"""``python -m conveyor.worker.entrypoints.cli``: the ``conveyor`` command."""

import sys

from conveyor.worker.entrypoints.cli import main

sys.exit(main())
