"""The local stack's and the demo's defaults, each defined once.

``atoll up``, ``atoll deploy``, ``atoll demo``, :class:`~atoll.ops.stack.LocalStack` and
:func:`~atoll.ops.deploy.deploy_all` read them from here. No Prefect or torch import, so the CLI
reads them to build its flags without slowing down ``atoll --help``.
"""

from __future__ import annotations

__all__ = ["DEFAULT_POOLS", "DEFAULT_PORT", "DEMO_DIR"]

DEFAULT_POOLS: tuple[str, ...] = ("cpu-fast", "cpu-slow")
"""The two local process pools of the embedded stack (standing in for two chip generations); the
demo and smoke presets put their learners on them (``atoll.train.recipe``)."""

DEFAULT_PORT = 4200
"""The local Prefect server's port (Prefect's own default), or the next free one."""

DEMO_DIR = "out/demo"
"""Where ``atoll demo`` keeps the bucket, the Prefect home and the logs."""
