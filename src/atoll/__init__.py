"""atoll: Decoupled DiLoCo across compute islands, on Prefect 3 and object storage.

``atoll.join`` (bring your own training loop, :mod:`atoll.train.hook`) and ``atoll.create_run``
(the one way to create a run, :mod:`atoll.train.run`) are imported lazily, so ``import atoll``
stays light.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["create_run", "join"]


def __getattr__(name: str) -> Any:
    if name == "join":
        from atoll.train import hook

        return hook.join
    if name == "create_run":
        from atoll.train import run

        return run.create_run
    raise AttributeError(f"module 'atoll' has no attribute {name!r}")
