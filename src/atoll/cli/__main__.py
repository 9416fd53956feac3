"""``python -m atoll.cli``: the ``atoll`` command."""

import sys

from atoll.cli import main

sys.exit(main())
