"""python -m llamarl.service RECIPE [key=value ...] (docs/service.md)."""

import sys

from llamarl.service.server import main

sys.exit(main(sys.argv[1:]))
