import os

# CPU work shares 2 cores with other processes in CI: don't spin idle OpenMP threads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
