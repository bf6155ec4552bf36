"""Iterative offline GRPO that trains an LLM to write agentic workflows (SPOGW / ioGRPO)."""

__version__ = "0.1.0"

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # the CLI's and a stage child's log lines alike
