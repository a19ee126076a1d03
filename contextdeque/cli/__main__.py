"""``python -m contextdeque.cli COMMAND ...``: the same as the ``contextdeque`` script."""

import sys

from contextdeque.cli import main

sys.exit(main())
