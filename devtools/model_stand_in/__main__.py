"""``python -m devtools.model_stand_in`` — see :mod:`devtools.model_stand_in.cli`."""
import sys

from devtools.model_stand_in.cli import main

sys.exit(main())
