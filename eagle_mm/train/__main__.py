"""`python -m eagle_mm.train ...` and `accelerate launch -m eagle_mm.train ...`."""

import sys

from eagle_mm.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
