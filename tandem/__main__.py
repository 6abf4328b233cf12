"""``python -m tandem``: the same command as ``tandem``."""

import sys

from tandem.cli import main

sys.exit(main())
