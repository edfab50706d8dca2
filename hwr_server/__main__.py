import sys

from hwr_server.cli import main

sys.exit(main())
