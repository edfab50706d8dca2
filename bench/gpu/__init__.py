"""bench/gpu: the one GPU command (run.sh) and its steps (runner.py)."""
