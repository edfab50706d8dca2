"""Where the checkout is, for tests that run its scripts or read its files."""

import os

#: The repository root (the folder holding pyproject.toml).
REPO_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
