"""``python -m pareprop <command>``: the same entry point as the ``pareprop`` console script."""

import sys

from pareprop.cli import main

if __name__ == "__main__":
    sys.exit(main())
