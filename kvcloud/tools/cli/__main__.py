"""``python -m kvcloud.tools.cli``: the ``kvcloud`` command."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
