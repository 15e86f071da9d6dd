"""``python -m linearize ...`` = ``linearize ...``."""

import sys

from .cli import main

sys.exit(main())
