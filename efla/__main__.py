"""``python -m efla`` is the same as the ``efla`` command."""

import sys

from efla.cli import main

sys.exit(main())
