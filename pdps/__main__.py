import sys

from pdps.cli import main

sys.exit(main())
