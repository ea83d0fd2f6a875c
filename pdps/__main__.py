import sys

from pdps.shell.cli import main

sys.exit(main())
