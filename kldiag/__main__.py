"""`python -m kldiag`: the `kldiag` command (kldiag.cli.main), for environments without the script."""

import sys

from kldiag.cli import main

sys.exit(main())
