"""The layering checks of test_layers.py, run on a synthetic source tree that breaks each rule.

A checker whose assertion never fires proves nothing: here test_layers' own test functions run
against a small ``atoll`` package written to tmp_path (by pointing their ``SRC`` there), and must
fail with the violation named -- and pass on a tree that follows the rules.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import test_layers as layers


def write_tree(root: Path, files: dict[str, str]) -> Path:
    src = root / "src" / "atoll"
    for rel, text in files.items():
        path = src / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for pkg in {p.split("/")[0] for p in files if "/" in p}:
        (src / pkg / "__init__.py").touch()
    return src


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    def make(files: dict[str, str]) -> Path:
        src = write_tree(tmp_path, files)
        monkeypatch.setattr(layers, "SRC", src)
        return src
    return make


def test_an_import_pointing_up_fails_and_names_the_violation(tree) -> None:
    src = tree({"core/ok.py": "import torch\n",
                "storage/bad.py": "import os\nfrom atoll.core import ok\n\ndef f():\n    import atoll.train.model\n"})
    layers.test_imports_point_down(src / "core" / "ok.py")  # core imports only torch: fine
    with pytest.raises(AssertionError, match=r"storage/bad\.py:5 imports atoll\.train\.model: layer 'storage' "
                                             r"must not depend on 'train'"):
        layers.test_imports_point_down(src / "storage" / "bad.py")  # even inside a function


def test_a_relative_import_pointing_up_fails(tree) -> None:
    src = tree({"core/rel.py": "from ..storage import bucket\n"})
    with pytest.raises(AssertionError, match=r"core/rel\.py:1 imports atoll\.storage: layer 'core' must not depend"):
        layers.test_imports_point_down(src / "core" / "rel.py")


def test_storage_and_sim_may_not_import_each_other(tree) -> None:
    src = tree({"sim/x.py": "from atoll.storage import bucket\n", "storage/y.py": "import atoll.core\n"})
    layers.test_imports_point_down(src / "storage" / "y.py")
    with pytest.raises(AssertionError, match=r"sim/x\.py:1.*storage"):
        layers.test_imports_point_down(src / "sim" / "x.py")


def test_core_may_import_only_torch_and_the_standard_library(tree) -> None:
    tree({"core/a.py": "import math\nimport torch\nfrom atoll.core import b\n", "core/b.py": "import numpy\n"})
    with pytest.raises(AssertionError, match=r"core/b\.py:1 imports numpy; core may use torch \+ stdlib only"):
        layers.test_core_imports_only_torch_and_stdlib()


def test_a_tree_that_follows_the_rules_passes(tree) -> None:
    src = tree({"core/a.py": "import math\nimport torch\n", "storage/s.py": "from atoll.core import a\n",
                "train/t.py": "from atoll.storage import s\nfrom atoll.core import a\n"})
    layers.test_core_imports_only_torch_and_stdlib()
    for path in sorted(src.rglob("*.py")):
        layers.test_imports_point_down(path)


def test_an_import_circle_fails_and_names_the_loop(tree) -> None:
    tree({"ops/a.py": "from atoll.ops.b import g\n", "ops/b.py": "def g():\n    from atoll.ops import a\n",
          "ops/c.py": "from atoll.ops import a\n"})
    with pytest.raises(AssertionError, match=r"import circle: atoll\.ops\.a -> atoll\.ops\.b -> atoll\.ops\.a"):
        layers.test_no_import_circle()


def test_modules_that_import_one_way_pass_the_circle_check(tree) -> None:
    tree({"ops/a.py": "from atoll.ops.b import g\n", "ops/b.py": "import os\n", "ops/c.py": "from atoll.ops import a, b\n"})
    layers.test_no_import_circle()
