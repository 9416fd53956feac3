"""atoll: Decoupled DiLoCo across compute islands, on Prefect 3 and object storage."""

__version__ = "0.1.0"
