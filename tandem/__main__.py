"""``python -m tandem``: the same command as ``tandem``."""

import sys

from tandem.cli import main

if __name__ == "__main__":  # not when a spawned process (a tensor-parallel rank) imports it
    sys.exit(main())
