"""``python -m service.cli``: the ``etrain`` command."""

import sys

from service.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
