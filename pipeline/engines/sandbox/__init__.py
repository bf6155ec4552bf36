"""Running untrusted workflows: a zygote forks one isolated child per run (see docs/sandbox.md).

Public API: `run_workflow` (async; `run_workflow_sync` without a loop), `run_test_suite`, `Limits`,
`SandboxResult`, `Sandbox` / `default_sandbox()`.
"""

from pipeline.engines.sandbox.client import (
    Limits,
    Sandbox,
    SandboxError,
    SandboxResult,
    build_messages,
    default_sandbox,
    run_test_suite,
    run_workflow,
    run_workflow_sync,
)

__all__ = ["Limits", "Sandbox", "SandboxError", "SandboxResult", "build_messages", "default_sandbox",
           "run_test_suite", "run_workflow", "run_workflow_sync"]
