"""Integrity of what the bucket publishes: a digest on every commit, a hash chain across commits,
and optional HMAC-SHA256 signatures with a per-writer keyring.

* **Digest.** Every commit record carries ``digest``: the sha256 of its own canonical JSON without
  the ``digest`` and ``signature`` fields. A flipped digit, a truncated write or any edit that does
  not recompute it is detected.
* **Chain.** Every commit record carries ``prev_sha256``: the sha256 of the previous commit
  record's bytes (round 1: of ``run.json``'s bytes). An overwritten commit no longer matches the
  link its successor holds, and every global state object is named by its sha256 in the state
  table, so the chain covers the whole published state.
* **Signatures** (optional). With a :class:`Keyring`, the synchronizer signs commits and each
  learner signs its contributions, with HMAC-SHA256 over the same canonical bytes. The
  synchronizer, holding every key, rejects an unsigned or wrongly signed contribution and never
  adopts an unsigned or forged commit. HMAC is symmetric: whoever can verify a signature can make
  one, so learners are given only their own key (they trust commits through the bucket policy,
  which lets no learner write under ``sync/``; see docs/protocol.md).

A digest or a chain cannot stop a writer who recomputes them: that is what the bucket policy and
the signatures are for.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from atoll.storage.codec import dump_record, sha256_hex
from atoll.storage.validation import StorageError

__all__ = [
    "SYNCHRONIZER_KEY_ID",
    "KEYRING_ENV",
    "IntegrityError",
    "Keyring",
    "seal",
    "check_seal",
    "SEAL_FIELDS",
]

SYNCHRONIZER_KEY_ID = "synchronizer"
"""The keyring entry of the synchronizer's key (learner entries are named by learner id)."""

KEYRING_ENV = "ATOLL_KEYRING"
"""Environment variable holding the keyring as JSON ``{"<id>": "<hex key>", ...}``."""

SEAL_FIELDS = ("digest", "signature")
"""Fields a seal adds to a record body; the digest and signature cover everything else."""


class IntegrityError(StorageError):
    """A committed object does not verify (digest, chain link or signature); it is never used."""

    def __init__(self, what: str, url: str) -> None:
        self.what, self.url = what, url
        super().__init__(f"{url}: {what}")


@dataclass(frozen=True)
class Keyring:
    """HMAC keys by writer id: ``"synchronizer"`` and learner ids. Empty = no signatures."""

    keys: Mapping[str, bytes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for kid, key in self.keys.items():
            if not isinstance(key, bytes) or len(key) < 16:
                raise ValueError(f"keyring entry {kid!r} must be at least 16 bytes")

    def __bool__(self) -> bool:
        return bool(self.keys)

    def key(self, writer: str) -> bytes | None:
        return self.keys.get(writer)

    def for_run(self, run_id: str) -> Keyring:
        """The keys a run signs and verifies with: each entry derived for ``run_id``
        (HMAC-SHA256(key, "atoll/run-key\\0" + run_id)). A signature then binds the run id: a
        record signed in one run never verifies in another run that shares the keyring."""
        tag = b"atoll/run-key\0" + run_id.encode()
        return Keyring({kid: hmac.new(key, tag, hashlib.sha256).digest() for kid, key in self.keys.items()})

    @classmethod
    def from_json(cls, text: str) -> Keyring:
        """``{"synchronizer": "<hex>", "learner-0": "<hex>", ...}`` (hex keys, >= 16 bytes each)."""
        data = json.loads(text)
        if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
            raise ValueError(f"{KEYRING_ENV} must be a JSON object of hex strings")
        return cls({str(k): bytes.fromhex(v) for k, v in data.items()})

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Keyring:
        """The keyring in ``$ATOLL_KEYRING`` (empty if unset). Prefect users put the JSON in a
        Secret block and expose it to the work pool as this variable (docs/protocol.md)."""
        text = (os.environ if environ is None else environ).get(KEYRING_ENV, "").strip()
        return cls.from_json(text) if text else cls()


def _canonical(kind: str, body: Mapping[str, Any]) -> bytes:
    return dump_record(kind, {k: v for k, v in body.items() if k not in SEAL_FIELDS})


def seal(kind: str, body: Mapping[str, Any], key: bytes | None = None) -> dict[str, Any]:
    """``body`` plus its ``digest`` (and ``signature`` when a key is given)."""
    canonical = _canonical(kind, body)
    out = {k: v for k, v in body.items() if k not in SEAL_FIELDS}
    out["digest"] = sha256_hex(canonical)
    if key is not None:
        out["signature"] = hmac.new(key, canonical, hashlib.sha256).hexdigest()
    return out


def check_seal(kind: str, body: Mapping[str, Any], *, url: str, key: bytes | None = None,
               require_signature: bool = False) -> None:
    """Raise IntegrityError unless ``body``'s digest (and signature, if a key is given or one is
    required) match its canonical bytes."""
    canonical = _canonical(kind, body)
    digest = body.get("digest")
    if digest != sha256_hex(canonical):
        raise IntegrityError("digest does not match the record's content (altered or corrupt)", url)
    signature = body.get("signature")
    if key is None:
        if require_signature:
            raise IntegrityError("no key to verify the record's signature", url)
        return
    if not isinstance(signature, str):
        raise IntegrityError("record is not signed, and this run requires signatures", url)
    expected = hmac.new(key, canonical, hashlib.sha256).hexdigest()
    if not hmac.compare_digest(signature, expected):
        raise IntegrityError("signature does not verify (forged, or signed with another key)", url)
