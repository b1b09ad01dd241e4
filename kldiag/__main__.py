import sys

from kldiag.cli import main

sys.exit(main())
