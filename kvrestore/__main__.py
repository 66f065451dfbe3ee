"""`python -m kvrestore ...` is the `kvrestore` command."""

import sys

from kvrestore.tools.cli import main

sys.exit(main())
