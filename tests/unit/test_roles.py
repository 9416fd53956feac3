"""Roles in code match the roles of the bucket policy (docs/protocol.md section 8).

Each principal opens the run through its own class, and a class carries only the writers its
principal is granted: a learner's handle cannot commit, checkpoint, stop the run or write the
retention record; a reader's writes nothing. The learner's modules under ``atoll.train`` never
import the synchronizer's, the operator's or the run creator's storage API (static AST, as in
test_layers.py, so a code path no test runs is covered too).
"""

from __future__ import annotations

import ast
import uuid
from pathlib import Path

import pytest

from atoll.storage import (
    LearnerStore,
    OperatorStore,
    RunCreator,
    RunHandle,
    RunReader,
    SynchronizerStore,
)

SRC = Path(__file__).resolve().parents[2] / "src" / "atoll"

LEARNER_WRITERS = {"publish_contribution", "save_learner_state", "take_learner_lease"}
LEASE_WRITERS = {"write_heartbeat"}
SYNCHRONIZER_WRITERS = {"commit_round", "write_round_payloads", "write_checkpoint", "write_eval", "take_synchronizer_lease", "mark_stopped",
                        "clear_stopped"}
OPERATOR_WRITERS = {"write_prune_record"}
CREATOR_WRITERS = {"init_run"}
ALL_WRITERS = LEARNER_WRITERS | LEASE_WRITERS | SYNCHRONIZER_WRITERS | OPERATOR_WRITERS | CREATOR_WRITERS

GRANTED = {
    RunReader: set(),
    LearnerStore: LEARNER_WRITERS | LEASE_WRITERS,
    SynchronizerStore: SYNCHRONIZER_WRITERS | LEASE_WRITERS,
    OperatorStore: OPERATOR_WRITERS,
    RunCreator: CREATOR_WRITERS,
}

LEARNER_SIDE = ["publisher", "hook", "learner", "fetcher", "inner", "inner_state", "session", "lease", "island",
                "device"]
"""The modules of ``atoll.train`` a learner process runs."""

NOT_FOR_LEARNERS = {"atoll.storage.synchronizer_side", "atoll.storage.operator_side", "atoll.storage.creation",
                    "atoll.train.synchronizer"}
NOT_FOR_LEARNERS_NAMES = {"SynchronizerStore", "OperatorStore", "RunCreator", "CommitResult"}


@pytest.mark.parametrize("role", list(GRANTED), ids=lambda c: c.__name__)
def test_each_role_has_exactly_its_writers(role: type) -> None:
    has = {name for name in ALL_WRITERS if hasattr(role, name)}
    assert has == GRANTED[role], f"{role.__name__} has writers {sorted(has - GRANTED[role])} it is not granted"


def test_a_learner_cannot_reach_a_synchronizer_or_operator_writer() -> None:
    for name in SYNCHRONIZER_WRITERS | OPERATOR_WRITERS | CREATOR_WRITERS:
        assert not hasattr(LearnerStore, name), f"LearnerStore.{name}"
    assert not issubclass(LearnerStore, (SynchronizerStore, OperatorStore, RunCreator))


@pytest.mark.parametrize("role", list(GRANTED), ids=lambda c: c.__name__)
def test_every_role_opens_as_itself(role: type[RunHandle]) -> None:
    handle = role.open(f"memory://atoll-roles-{uuid.uuid4().hex[:8]}/run")
    assert type(handle) is role and type(handle.sibling()) is role
    assert type(RunReader.beside(handle)) is RunReader


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    found: list[tuple[int, str, list[str]]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.lineno, node.module, [a.name for a in node.names]))
    return found


@pytest.mark.parametrize("name", LEARNER_SIDE)
def test_learner_side_modules_do_not_import_the_synchronizer_side(name: str) -> None:
    path = SRC / "train" / f"{name}.py"
    assert path.exists(), f"{path} is gone: update LEARNER_SIDE"
    for lineno, module, names in _imports(path):
        assert module not in NOT_FOR_LEARNERS, f"train/{name}.py:{lineno} imports {module}"
        assert not (module.startswith("atoll.") and set(names) & NOT_FOR_LEARNERS_NAMES), (
            f"train/{name}.py:{lineno} imports {sorted(set(names) & NOT_FOR_LEARNERS_NAMES)} from {module}")
