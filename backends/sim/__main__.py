import sys

from backends.sim.cli import main

sys.exit(main(sys.argv[1:]))
