import sys

from asrserve.cli import main

sys.exit(main())
