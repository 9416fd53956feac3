"""atoll.runs: run management and reporting without Prefect.

Creating, continuing and forking runs (``manage``); what a round looked like and goodput
(``goodput``, ``contributions``, ``traffic``), written for people (``render``, ``plots``) and
gathered for ``atoll status`` (``report``); the learner-healing policy (``healing``) and the
training run's options (``options``). Nothing here imports Prefect: ``atoll status`` and notebooks
use it as is.
"""
