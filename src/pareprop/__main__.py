"""``python -m pareprop <command>``: the same entry point as the ``pareprop`` console script."""

import sys

if __name__ == "__main__":
    try:  # Ctrl-C while pareprop (and torch) load: one line, no traceback
        from pareprop.cli import main
    except KeyboardInterrupt:
        print("pareprop: interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(main())
