import sys

from hwr_client.cli import main

sys.exit(main())
