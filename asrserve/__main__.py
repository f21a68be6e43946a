import sys

from asrserve.cli import main

# Guarded: the engine process (multiprocessing "spawn") imports this module again.
if __name__ == "__main__":
    sys.exit(main())
