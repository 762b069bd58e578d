"""``python -m derivgen.cli``: the ``derivgen`` command line."""

import sys

from derivgen.cli import main

sys.exit(main())
