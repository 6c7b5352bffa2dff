"""``python -m meshnet.backends``: the same as ``meshnet backends``."""

import sys

from meshnet.backends.cli import main

sys.exit(main())
