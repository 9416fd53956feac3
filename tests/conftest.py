"""Suite-wide settings.

One torch thread per test process: CI has 2 cores, and several tests start learner processes
(each with one thread) beside the test process; oversubscribed OpenMP threads spin and make the
suite many times slower without making any single test faster.
"""

from __future__ import annotations

import os

import torch

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
torch.set_num_threads(1)
