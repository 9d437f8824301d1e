"""`python -m fedprism ...` is the `fedprism` command."""

import sys

from fedprism.cli import main

sys.exit(main())
