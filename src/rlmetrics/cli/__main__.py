"""``python -m rlmetrics.cli``: the ``rlmetrics`` command."""

import sys

from rlmetrics.cli import main

if __name__ == "__main__":
    sys.exit(main())
