"""Iterative offline GRPO that trains an LLM to write agentic workflows (SPOGW / ioGRPO)."""

__version__ = "0.1.0"
