"""The train stage: LoRA on a round's curated rows with `training.objective` (GRPO with the advantage-masked KL by
default; docs/design.md §6), read top-down in `stage.py`: load → reference passes → optimise → write.

Words: a *row* is one member of one kept group (a sequence with that group's coefficient; a generation kept in several
groups is several rows); a *pass* is one forward/backward (`pipeline.core.packing.Pass`: the rows it trains, the
distinct sequences it computes; `training.micro_batch_*` size it); an optimiser *step* holds whole groups and runs
its passes (`PlannedStep`); `RefLogprobs` is the pair (π_old, reference) held fixed by the loss.

| module | what lives there |
|---|---|
| `stage.py` | `run_train`; the optimiser loop (`optimise`, `train_pass`), resume and progress, `write_outputs` |
| `setup.py` | `TrainSetup`, `check_objective`, `load_stage` (step 1) |
| `reference.py` | `RefLogprobs`, `reference_passes` (step 2): π_old recomputed or the rollout's, the reference |
| `data.py` | `TrainSequence`, `load_sequences`: kept `groups` rows joined to their generations |
| `policy.py` | `start_adapter`, `load_policy` (LoRA), `frozen_linears_bf16` |
| `plan.py` | `step_plan`: the optimiser steps and their passes (`pipeline.core.packing`), `pass_budget` |
| `batch.py` | a pass's tensors: `Batch` (split layout), `PackedBatch` (packed), `collate`, `pass_batch` |
| `kvcache.py` | the prompt's keys and values shared by its completions through HF's cache API; a shared prefix's once |
| `logprobs.py` | `completion_logprobs` (π_θ), `reference_logprobs` (no-grad, over passes, gathered over ranks) |
| `loss.py` | `pass_loss_input`: a pass's `LossInput`; two-level `step_weights`, `kl_masks`, `pass_shares` |
| `metrics.py` | `StepSums` (one rank's sums over a step's passes), `StepMetrics` (a `train_metrics` row) |

Each token is computed once (docs/performance.md): a step holds whole groups, a pass encodes each distinct prompt once
(the prompts' common prefix once, training.shared_prefix_min) and its completions attend to it, a sequence in several
rows of a step is computed once and carries the sum of their loss terms, and passes are packed by padded tokens.
`batch`, `kvcache` and `logprobs` import with torch alone (`pipeline bench train` runs them on a bare GPU machine);
polars, the store and the config load where used.
"""

from pipeline.core.grpo import grpo_mkl_loss  # the stage's loss, public under the stage's name
from pipeline.stages.train.stage import run_train

__all__ = ["grpo_mkl_loss", "run_train"]
