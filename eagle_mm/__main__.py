"""`python -m eagle_mm` runs the `eagle-mm` command line."""

import sys

from eagle_mm.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
