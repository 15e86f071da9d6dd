"""``python -m linearize.cli ...`` = ``linearize ...``."""

import sys

from . import main

sys.exit(main())
