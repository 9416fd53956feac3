"""Bucket credentials from a Prefect Secret block, never from plaintext job variables or parameters.

A deployment's job environment carries only the *name* of a Secret block,
``ATOLL_SECRET_BLOCK=<name>`` (``atoll deploy --secret-block NAME``). The block's value is a JSON
object of environment variables::

    prefect block create secret   # or, in Python:
    Secret(value={"AWS_ACCESS_KEY_ID": "...", "AWS_SECRET_ACCESS_KEY": "...",
                  "AWS_ENDPOINT_URL": "https://s3.example.com"}).save("atoll-bucket")

At the start of each learner flow run and training run, :func:`export_secret_env` loads it and
sets those variables in the process environment (variables that are already set win: a pool's
own secret mounts, e.g. kubernetes ``secretKeyRef``, take precedence), before the bucket is
opened, so s3fs / gcsfs / boto pick them up. Values never appear in flow-run parameters, job
variables or logs.

**Signing keys** travel the same way: ``ATOLL_KEYRING`` in the block holds the host's *private*
keys as a keyring JSON (``atoll keys new <writer>`` writes exactly that: ``{"learner-0":
"ed25519-private:<hex>"}``). Give each writer its own block (``atoll deploy --secret-block`` per
pool): the synchronizer's block holds only the synchronizer's key, a learner pool's only that
learner's. Public keys are not secret: they come from ``run.json`` (pinned at creation), or
``ATOLL_PUBLIC_KEYS`` in plain job variables (the synchronizer's key a learner expects, a learner
added after creation). A block whose ``ATOLL_KEYRING`` does not parse is refused when it is loaded,
naming the block, never the value (docs/protocol.md section 8).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, MutableMapping
from typing import Any, cast

__all__ = ["SECRET_BLOCK_ENV", "export_secret_env", "secret_env_values"]

KEYRING_ENV = "ATOLL_KEYRING"
"""The signing keys' variable (:data:`atoll.storage.integrity.KEYRING_ENV`)."""

SECRET_BLOCK_ENV = "ATOLL_SECRET_BLOCK"
"""Environment variable holding the name of the Prefect Secret block with the bucket credentials."""

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def secret_env_values(value: Any, *, block: str) -> dict[str, str]:
    """The environment variables in a Secret block's value (a JSON object of NAME -> string)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"Secret block {block!r} must hold a JSON object of environment variables") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"Secret block {block!r} must hold a JSON object of environment variables, "
                         f"got {type(value).__name__}")
    out: dict[str, str] = {}
    for key, v in value.items():
        if not isinstance(key, str) or not _ENV_NAME.match(key):
            raise ValueError(f"Secret block {block!r}: {key!r} is not an environment variable name")
        if not isinstance(v, str | int | float) or isinstance(v, bool):
            raise ValueError(f"Secret block {block!r}: the value of {key} must be a string")
        out[key] = str(v)
    if KEYRING_ENV in out:
        from atoll.storage.integrity import Keyring

        try:
            Keyring.from_json(out[KEYRING_ENV])
        except ValueError:  # its message may quote key material: name the block only
            raise ValueError(f"Secret block {block!r}: {KEYRING_ENV} is not a keyring (a JSON object of "
                             f"'ed25519-private:<hex>', 'ed25519-public:<hex>' or hex HMAC keys)") from None
    return out


def export_secret_env(block: str | None = None, *, environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Load the Secret block named by ``block`` (default: ``$ATOLL_SECRET_BLOCK``) into the environment.

    Returns the names of the variables it set (values are never returned or logged). Nothing
    happens when no block is named.
    """
    env: MutableMapping[str, str] = os.environ if environ is None else environ
    name = block or env.get(SECRET_BLOCK_ENV, "")
    if not name:
        return []
    from prefect.blocks.system import Secret

    secret = cast(Secret[Any], Secret.load(name))  # sync call from a sync flow: the block, not a coroutine
    values = secret_env_values(secret.get(), block=name)
    exported = []
    for key, v in values.items():
        if key not in env:
            env[key] = v
            exported.append(key)
    return exported
