"""``python -m elastic.prefork (SCRIPT | -m MODULE) [ARGS...]``: see :mod:`elastic.prefork`."""

import sys

from elastic.prefork.client import main

sys.exit(main())
