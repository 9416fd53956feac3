"""atoll.sim: a fleet simulator and a bandwidth planner for Decoupled DiLoCo.

The simulator's hot path is numpy and the standard library; round closing uses
:func:`atoll.core.quorum.decide_round`, the same decision function as the real synchronizer.
"""
