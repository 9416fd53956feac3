"""Integrity of what the bucket publishes: a digest on every commit, a hash chain across commits,
and optional signatures (Ed25519, or HMAC-SHA256 on one host) with a per-writer keyring.

* **Digest.** Every commit record carries ``digest``: the sha256 of its own canonical JSON without
  the ``digest`` and ``signature`` fields. A flipped digit, a truncated write or any edit that does
  not recompute it is detected.
* **Chain.** Every commit record carries ``prev_sha256``: the sha256 of the previous commit
  record's bytes (round 1: of ``run.json``'s bytes). An overwritten commit no longer matches the
  link its successor holds, and every global state object is named by its sha256 in the state
  table, so the chain covers the whole published state.
* **Signatures** (optional; :mod:`atoll.storage.signing`). With Ed25519 keys, the synchronizer
  signs what it writes with its private key and pins its public key (and the learners') in
  ``run.json``; each learner signs its contributions with its own private key; every reader,
  learners included, verifies with public keys only. With HMAC keys (:class:`Keyring` entries
  that are bytes), the same records carry HMAC-SHA256 signatures: whoever can verify one can make
  one, so learners hold only their own key and cannot check what the synchronizer signs.

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

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from atoll.storage.codec import dump_record, sha256_hex
from atoll.storage.signing import HmacKey, KeyEntry, Signer, Verifier, parse_key_text, public_of, public_raw
from atoll.storage.validation import StorageError

__all__ = [
    "SYNCHRONIZER_KEY_ID",
    "KEYRING_ENV",
    "PUBLIC_KEYS_ENV",
    "IntegrityError",
    "Keyring",
    "seal",
    "check_seal",
    "SEAL_FIELDS",
]

SYNCHRONIZER_KEY_ID = "synchronizer"
"""The keyring entry of the synchronizer's key (learner entries are named by learner id)."""

KEYRING_ENV = "ATOLL_KEYRING"
"""Environment variable holding the keyring as JSON ``{"<id>": "<key text>", ...}``: the
process's private keys (``ed25519-private:<hex>``) or HMAC keys (bare hex), and any public keys
(``ed25519-public:<hex>``). Private keys belong in a Prefect Secret block (docs/protocol.md §8)."""

PUBLIC_KEYS_ENV = "ATOLL_PUBLIC_KEYS"
"""Environment variable holding public keys only, as JSON ``{"<id>": "ed25519-public:<hex>"}``:
not secret, so it may sit in job variables (e.g. the synchronizer's key a learner expects)."""

SEAL_FIELDS = ("digest", "signature")
"""Fields a seal adds to a record body; the digest and signature cover everything else."""


class IntegrityError(StorageError):
    """A committed object does not verify (digest, chain link or signature); it is never used."""

    def __init__(self, what: str, url: str) -> None:
        self.what, self.url = what, url
        super().__init__(f"{url}: {what}")


@dataclass(frozen=True)
class Keyring:
    """Keys by writer id (``"synchronizer"`` and learner ids). Empty = no signatures.

    An entry is an HMAC secret (``bytes``, 16+), an Ed25519 private key (this process signs as
    that writer) or an Ed25519 public key (this process verifies that writer: the synchronizer's
    here is an *anchor* that ``run.json`` must pin; a learner's overrides the run's registry)."""

    keys: Mapping[str, KeyEntry] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for kid, key in self.keys.items():
            if isinstance(key, Ed25519PrivateKey | Ed25519PublicKey):
                continue
            if not isinstance(key, bytes) or len(key) < 16:
                raise ValueError(f"keyring entry {kid!r} must be at least 16 bytes")

    def __bool__(self) -> bool:
        return bool(self.keys)

    def key(self, writer: str) -> bytes | None:
        """``writer``'s HMAC secret, if its entry is one."""
        entry = self.keys.get(writer)
        return entry if isinstance(entry, bytes) else None

    def private(self, writer: str) -> Ed25519PrivateKey | None:
        """``writer``'s Ed25519 private key, if this keyring holds it."""
        entry = self.keys.get(writer)
        return entry if isinstance(entry, Ed25519PrivateKey) else None

    def public(self, writer: str) -> Ed25519PublicKey | None:
        """``writer``'s Ed25519 public key (of a public or a private entry)."""
        entry = self.keys.get(writer)
        return public_of(entry) if isinstance(entry, Ed25519PrivateKey | Ed25519PublicKey) else None

    def publics(self) -> dict[str, Ed25519PublicKey]:
        """Every Ed25519 entry's public key, by writer id."""
        return {kid: k for kid in self.keys if (k := self.public(kid)) is not None}

    def unanchored(self) -> Keyring:
        """This keyring without an Ed25519 ``synchronizer`` entry: for reading another run (a
        fork's source) checked against the key its own run.json pins, not this run's anchor."""
        return Keyring({kid: k for kid, k in self.keys.items()
                        if kid != SYNCHRONIZER_KEY_ID or isinstance(k, bytes)})

    def for_run(self, run_id: str) -> Keyring:
        """The keys a run signs and verifies with: each HMAC entry derived for ``run_id``
        (HMAC-SHA256(key, "atoll/run-key\\0" + run_id)), so a signature binds the run id: a
        record signed in one run never verifies in another run that shares the keyring. Ed25519
        entries are kept as they are: their messages carry the run id (``signing.run_context``)."""
        tag = b"atoll/run-key\0" + run_id.encode()
        return Keyring({kid: hmac.new(key, tag, hashlib.sha256).digest() if isinstance(key, bytes) else key
                        for kid, key in self.keys.items()})

    @classmethod
    def from_json(cls, text: str, *, public_only: bool = False) -> Keyring:
        """``{"synchronizer": "<key text>", "learner-0": "<key text>", ...}``: see
        :func:`atoll.storage.signing.parse_key_text`. ``public_only``: refuse anything but
        ``ed25519-public:`` entries (for :data:`PUBLIC_KEYS_ENV`)."""
        name = PUBLIC_KEYS_ENV if public_only else KEYRING_ENV
        data = json.loads(text)
        if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
            raise ValueError(f"{name} must be a JSON object of key strings")
        keys = {str(k): parse_key_text(v, what=f"{name}[{k!r}]") for k, v in data.items()}
        if public_only and not all(isinstance(v, Ed25519PublicKey) for v in keys.values()):
            raise ValueError(f"{name} holds public keys only (ed25519-public:<hex>); private keys go in {KEYRING_ENV}")
        return cls(keys)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Keyring:
        """The keyring in ``$ATOLL_KEYRING`` plus the public keys in ``$ATOLL_PUBLIC_KEYS`` (empty
        if neither is set). Prefect users put the private JSON in a Secret block
        (:mod:`atoll.flows.credentials`) and expose it to the work pool as that variable."""
        env = os.environ if environ is None else environ
        text, public = env.get(KEYRING_ENV, "").strip(), env.get(PUBLIC_KEYS_ENV, "").strip()
        keys = dict(cls.from_json(text).keys) if text else {}
        publics = cls.from_json(public, public_only=True).publics() if public else {}
        for kid, pub in publics.items():
            mine = keys.get(kid)
            if isinstance(mine, Ed25519PrivateKey | Ed25519PublicKey) and public_raw(public_of(mine)) != public_raw(pub):
                raise ValueError(f"{PUBLIC_KEYS_ENV}[{kid!r}] is not the public half of {KEYRING_ENV}[{kid!r}]")
            keys.setdefault(kid, pub)
        return cls(keys)


def _canonical(kind: str, body: Mapping[str, Any]) -> bytes:
    return dump_record(kind, {k: v for k, v in body.items() if k not in SEAL_FIELDS})


def _signer(key: bytes | Signer | None) -> Signer | None:
    return HmacKey(key) if isinstance(key, bytes) else key


def seal(kind: str, body: Mapping[str, Any], key: bytes | Signer | None = None) -> dict[str, Any]:
    """``body`` plus its ``digest`` (and ``signature`` when a signer, or an HMAC key, is given)."""
    canonical = _canonical(kind, body)
    out = {k: v for k, v in body.items() if k not in SEAL_FIELDS}
    out["digest"] = sha256_hex(canonical)
    if (signer := _signer(key)) is not None:
        out["signature"] = signer.sign(canonical)
    return out


def check_seal(kind: str, body: Mapping[str, Any], *, url: str, key: bytes | Verifier | None = None,
               require_signature: bool = False) -> None:
    """Raise IntegrityError unless ``body``'s digest (and signature, if a verifier or HMAC key is
    given or one is required) match its canonical bytes. The verifier alone decides the scheme."""
    canonical = _canonical(kind, body)
    digest = body.get("digest")
    if digest != sha256_hex(canonical):
        raise IntegrityError("digest does not match the record's content (altered or corrupt)", url)
    signature = body.get("signature")
    verifier: Verifier | None = HmacKey(key) if isinstance(key, bytes) else key
    if verifier is None:
        if require_signature:
            raise IntegrityError("no key to verify the record's signature", url)
        return
    if not isinstance(signature, str):
        raise IntegrityError("record is not signed, and this run requires signatures", url)
    if not verifier.verify(canonical, signature):
        raise IntegrityError(f"signature does not verify with the writer's {verifier.scheme} key "
                             "(forged, or signed with another key)", url)
