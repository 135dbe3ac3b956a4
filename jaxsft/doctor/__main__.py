"""`python -m jaxsft.doctor RUN_DIR`."""

import sys

from jaxsft.doctor import main

if __name__ == "__main__":
  sys.exit(main())
