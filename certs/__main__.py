import sys

from certs.cli import main

sys.exit(main())
