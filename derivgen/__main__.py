import sys

from derivgen.cli import main

sys.exit(main())
