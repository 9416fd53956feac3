"""atoll: Decoupled DiLoCo across compute islands, on Prefect 3 and object storage.

``atoll.join`` and ``atoll.create_run_for`` (bring your own training loop, :mod:`atoll.train.hook`)
are imported lazily, so ``import atoll`` stays light.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["create_run_for", "join"]


def __getattr__(name: str) -> Any:
    if name in ("join", "create_run_for"):
        from atoll.train import hook

        return getattr(hook, name)
    raise AttributeError(f"module 'atoll' has no attribute {name!r}")
