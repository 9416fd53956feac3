"""The Dockerfile and .dockerignore, checked offline (no docker daemon, no linter to install):
a small parser of Dockerfile instructions and the rules the image must keep."""

from __future__ import annotations

import fnmatch
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INSTRUCTIONS = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME", "USER",
                "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL"}
CREDENTIAL = re.compile(r"(SECRET|PASSWORD|TOKEN|ACCESS_KEY|PRIVATE_KEY|API_KEY|KEYRING)", re.I)


def parse_dockerfile(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: comments dropped, backslash continuations joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "the Dockerfile ends inside a line continuation"
    return out


def _env_pairs(args: str) -> dict[str, str]:
    parts = shlex.split(args)
    if len(parts) >= 2 and "=" not in parts[0]:  # legacy `ENV KEY value`
        return {parts[0]: " ".join(parts[1:])}
    return dict(p.split("=", 1) for p in parts)


def test_parser_on_a_sample() -> None:
    got = parse_dockerfile("# c\nARG B=x\nFROM ${B}\nRUN a \\\n  && b\n\nUSER 1:1\n")
    assert got == [("ARG", "B=x"), ("FROM", "${B}"), ("RUN", "a  && b"), ("USER", "1:1")]


def test_dockerfile_rules() -> None:
    steps = parse_dockerfile((ROOT / "Dockerfile").read_text())
    words = [w for w, _ in steps]
    assert set(words) <= INSTRUCTIONS, set(words) - INSTRUCTIONS
    # FROM first (only ARGs, which parameterise FROM, may precede it).
    first_from = words.index("FROM")
    assert all(w == "ARG" for w in words[:first_from])
    args = {k: v for d in [_env_pairs(a) for w, a in steps[:first_from] if w == "ARG"] for k, v in d.items()}
    image = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], steps[first_from][1].split()[0])
    # A CUDA-enabled torch base.
    assert re.fullmatch(r"pytorch/pytorch:[\d.]+-cuda[\d.]+-cudnn\d+-runtime", image), image
    # Runs as a non-root user, by number (so kubernetes can check runAsNonRoot).
    users = [a for w, a in steps if w == "USER"]
    assert users, "no USER: the image would run as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, users[-1]
    assert words.index("USER") > max(i for i, w in enumerate(words) if w == "RUN" and "pip install" in steps[i][1])
    # No secrets baked in: no credential-looking ENV/ARG names, no ADD from URLs.
    for w, a in steps:
        if w in ("ENV", "ARG"):
            for key in _env_pairs(a) if "=" in a or w == "ENV" else [a]:
                assert not CREDENTIAL.search(key), f"{w} {key}: credentials must not live in the image"
        assert w != "ADD", "use COPY (ADD fetches URLs and unpacks archives)"
    # COPY sources exist and are not excluded by .dockerignore.
    ignore = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
              if ln.strip() and not ln.startswith("#")]
    for w, a in steps:
        if w != "COPY":
            continue
        parts = [p for p in a.split() if not p.startswith("--")]
        for src in parts[:-1]:
            assert (ROOT / src).exists(), f"COPY {src}: no such path"
            assert _included(src.rstrip("/"), ignore), f"COPY {src}: excluded by .dockerignore"
    # atoll is installed and the default command exists.
    assert any(w == "RUN" and "pip install ." in a for w, a in steps)
    assert [w for w in words if w == "CMD"], "no CMD"


def _included(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; '!' re-includes."""
    keep = True
    for pat in patterns:
        negate = pat.startswith("!")
        p = pat[1:] if negate else pat
        p = p.rstrip("/")
        if p == "**" or fnmatch.fnmatch(path, p) or fnmatch.fnmatch(path, p.replace("**/", "")):
            keep = negate
    return keep


def test_dockerignore_is_an_allow_list() -> None:
    patterns = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    assert patterns[0] == "**"
    for secret in (".env", "credentials.json", ".aws", ".git", ".venv", "out", "tests", "id_rsa"):
        assert not _included(secret, patterns), secret
    for needed in ("pyproject.toml", "README.md", "src"):
        assert _included(needed, patterns), needed
