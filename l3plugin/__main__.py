import sys

from l3plugin.cli import main

sys.exit(main())
