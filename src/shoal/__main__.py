import sys

from shoal.cli import main

if __name__ == "__main__":  # a forked worker's server imports this module again as __mp_main__
    sys.exit(main())
