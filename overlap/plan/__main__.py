"""``python -m overlap.plan``: the same as ``overlap-plan``."""

import sys

from overlap.plan.cli import main

if __name__ == "__main__":
    sys.exit(main())
