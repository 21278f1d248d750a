"""One script per measured claim, each against its peer in the same run, run from the repository root as a
module (`python -m benchmarks.NAME`, each one's docstring says how); their figures, with the commands that
made them, are the result pages beside them (README.md, gpu.md, planner.md).

Shared by several: harness.py (running a command with a timeout and its log, a script's Bench, a config read from
configs/ with what a run changes merged in, reading metrics.jsonl), read_counter.py (the host's reads of tensor
values, step by step: also tests/dist/test_host_reads.py's). The GPU scripts come with a .sh that runs them where
python3 has a CUDA torch and not shoal's other dependencies (gpu_run.sh).
"""
