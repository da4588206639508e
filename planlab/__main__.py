"""``python -m planlab``: the ``planlab`` command, without the console script on PATH."""

import sys

from planlab.cli import main

if __name__ == "__main__":
    sys.exit(main())
