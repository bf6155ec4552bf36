"""`python -m pipeline.stages STAGE ...`: one stage in this process (the runner's child side)."""

import sys

from pipeline.stages.runner import child_main

sys.exit(child_main())
