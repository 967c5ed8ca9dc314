"""`python -m workshop COMMAND`: the command line of the workshop (workshop/cli.py)."""

import sys

from workshop.cli import main

sys.exit(main())
