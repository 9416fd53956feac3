"""``atoll keys``: Ed25519 keys for signed runs (docs/protocol.md section 8).

``atoll keys new WRITER`` writes a private key file (mode 0600, never overwritten) holding the
keyring entry ``{"<writer>": "ed25519-private:<hex>"}``, the value ``ATOLL_KEYRING`` takes (keep it
in a Prefect Secret block: :mod:`atoll.flows.credentials`), and prints the public entry
``{"<writer>": "ed25519-public:<hex>"}``, which is not secret. ``atoll keys public FILE`` prints the
public entries of a key file again.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

__all__ = ["add_keys", "new_key_file", "public_entries"]


def add_keys(sub: Any) -> None:
    p = sub.add_parser("keys", help="Ed25519 keys: a private key file per writer, its public key to share")
    keys_sub = p.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    new = keys_sub.add_parser("new", help="write a new private key file; print its public key")
    new.add_argument("writer", help="'synchronizer' or a learner id")
    new.add_argument("--out", default=None, help="private key file to write (default: <writer>.key)")
    new.set_defaults(handler=_new)
    pub = keys_sub.add_parser("public", help="print the public keys of a private key file")
    pub.add_argument("key_file")
    pub.set_defaults(handler=_public)


def new_key_file(writer: str, path: str) -> str:
    """Write a fresh private key for ``writer`` to ``path`` (created 0600; FileExistsError if it
    exists: a key is never overwritten) and return its public keyring entry as JSON."""
    from atoll.storage.integrity import SYNCHRONIZER_KEY_ID
    from atoll.storage.signing import new_private_key, private_text, public_text
    from atoll.storage.validation import validate_learner_id

    if writer != SYNCHRONIZER_KEY_ID:
        validate_learner_id(writer)
    key = new_private_key()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({writer: private_text(key)}) + "\n")
    return json.dumps({writer: public_text(key)})


def public_entries(path: str) -> str:
    """The public keyring entries of the key file at ``path``, as JSON."""
    from atoll.storage.integrity import Keyring
    from atoll.storage.signing import public_text

    with open(path) as f:
        keyring = Keyring.from_json(f.read())
    return json.dumps({w: public_text(k) for w, k in keyring.publics().items()})


def _new(args: argparse.Namespace) -> int:
    path = args.out or f"{args.writer}.key"
    print(new_key_file(args.writer, path))
    print(f"private key written to {path} (mode 0600): put its content in a Prefect Secret block as "
          f"ATOLL_KEYRING for {args.writer!r}'s hosts only; the line above is public (docs/protocol.md §8)",
          file=sys.stderr)
    return 0


def _public(args: argparse.Namespace) -> int:
    print(public_entries(args.key_file))
    return 0
