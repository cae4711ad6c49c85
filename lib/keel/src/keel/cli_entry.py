"""`python -m keel.cli_entry ...` is the `keel` console script (used where no script is installed)."""

import sys

from keel.cli import console_main

if __name__ == "__main__":
    sys.exit(console_main())
