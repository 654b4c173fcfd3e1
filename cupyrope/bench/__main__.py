"""``python -m cupyrope.bench``: the reference sweep (see :mod:`cupyrope.bench.cli`)."""

import sys

from .cli import main

sys.exit(main())
