"""atoll.sim: a fleet simulator and a bandwidth planner for Decoupled DiLoCo.

The simulator's hot path is numpy and the standard library; rounds close as
:func:`atoll.core.quorum.decide_round`, the real synchronizer's decision function, says (by
default through :func:`atoll.sim.quorum_fast.decide_fast`, which returns the same decision).
"""
