"""`python -m kvrestore ...` is the `kvrestore` command."""

import sys

from .cli import main

sys.exit(main())
