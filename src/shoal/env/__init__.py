"""`shoal env`: what this machine and its Python environment have (facts.py: versions, GPUs, the backend a
run would take, extras, tcmalloc, /dev/shm, cached planner profiles, and what stops training, one line
each), and `--check`, a few seconds that say whether it trains (check.py: collectives, matmul, one step)."""
