import sys

from conch.cli import main

sys.exit(main())
