"""``python -m devtools.faults`` — see :mod:`devtools.faults`."""
import sys

from devtools.faults.cli import main

sys.exit(main())
