import sys

from splitfed.cli import main

sys.exit(main())
