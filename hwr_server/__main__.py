import sys

from hwr_client.cli import main

sys.exit(main(["serve", *sys.argv[1:]]))
