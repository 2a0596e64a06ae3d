"""`python -m flintc` runs the command line."""

import sys

from flintc.cli import main

sys.exit(main())
