"""Signature schemes for sealed records: Ed25519 (public-key) and HMAC-SHA256 (shared secret).

A record's ``signature`` field names its scheme: ``ed25519:<128 hex>`` or, as atoll has always
written it, a bare hex HMAC-SHA256 (``hmac-sha256:<hex>`` is read too). The *verifier* decides
which scheme it accepts from the key it holds, never from the record: an Ed25519 key refuses
every HMAC, so a writer cannot downgrade a record to the scheme it can forge.

* **Ed25519** (:class:`Ed25519Signer`, :class:`Ed25519Verifier`): the synchronizer and each
  learner sign with their own private key; every reader verifies with public keys only. The run
  pins the synchronizer's public key, and the learners' it was created with, in ``run.json``
  (:class:`PinnedKeys`). The signed message is ``"atoll/ed25519/v1\\0" + run_id + "\\0"`` followed
  by the record's canonical bytes, so a signature binds the run id.
* **HMAC-SHA256** (:class:`HmacKey`): one secret per writer, derived per run id
  (:meth:`atoll.storage.integrity.Keyring.for_run`); whoever can verify can sign, so it suits
  runs on one host, where one party holds every key.

Key text (``ATOLL_KEYRING`` values, files from ``atoll keys new``): ``ed25519-private:<64 hex>``
(the 32-byte seed), ``ed25519-public:<64 hex>``, or a bare hex HMAC secret.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

__all__ = [
    "ED25519",
    "HMAC_SHA256",
    "PRIVATE_PREFIX",
    "PUBLIC_PREFIX",
    "Signer",
    "Verifier",
    "HmacKey",
    "Ed25519Signer",
    "Ed25519Verifier",
    "PinnedKeys",
    "KeyEntry",
    "run_context",
    "new_private_key",
    "private_text",
    "public_text",
    "public_raw",
    "parse_key_text",
    "public_of",
]

ED25519 = "ed25519"
"""The public-key scheme: signatures read ``ed25519:<hex>``."""

HMAC_SHA256 = "hmac-sha256"
"""The shared-secret scheme: signatures are bare hex (or ``hmac-sha256:<hex>``)."""

PRIVATE_PREFIX = "ed25519-private:"
PUBLIC_PREFIX = "ed25519-public:"

KeyEntry = bytes | Ed25519PrivateKey | Ed25519PublicKey
"""One keyring entry: an HMAC secret, an Ed25519 private key (signs) or public key (verifies)."""


class Signer(Protocol):
    """Makes the ``signature`` field of a record from its canonical bytes."""

    @property
    def scheme(self) -> str: ...

    def sign(self, canonical: bytes) -> str: ...


class Verifier(Protocol):
    """Checks the ``signature`` field of a record against its canonical bytes."""

    @property
    def scheme(self) -> str: ...

    def verify(self, canonical: bytes, signature: str) -> bool: ...


def run_context(run_id: str) -> bytes:
    """What every Ed25519 message of run ``run_id`` starts with (domain separation and run binding)."""
    return b"atoll/ed25519/v1\0" + run_id.encode() + b"\0"


@dataclass(frozen=True)
class HmacKey:
    """HMAC-SHA256 with one (already run-derived) secret: signs and verifies."""

    secret: bytes
    """The writer's key for this run (``Keyring.for_run``)."""
    scheme: str = HMAC_SHA256

    def sign(self, canonical: bytes) -> str:
        # Bare hex: the format every HMAC-signed run has always carried.
        return hmac.new(self.secret, canonical, hashlib.sha256).hexdigest()

    def verify(self, canonical: bytes, signature: str) -> bool:
        text = signature.removeprefix(HMAC_SHA256 + ":")
        return text.isascii() and hmac.compare_digest(text, self.sign(canonical))


@dataclass(frozen=True)
class Ed25519Signer:
    """An Ed25519 private key signing for one run."""

    private: Ed25519PrivateKey
    """The writer's private key (from ``ATOLL_KEYRING``, never from the bucket)."""
    context: bytes
    """:func:`run_context` of the run it signs for."""
    scheme: str = ED25519

    def sign(self, canonical: bytes) -> str:
        return f"{ED25519}:{self.private.sign(self.context + canonical).hex()}"


@dataclass(frozen=True)
class Ed25519Verifier:
    """An Ed25519 public key verifying one run's records."""

    public: Ed25519PublicKey
    """The writer's public key (pinned in run.json, or the reader's own keyring entry)."""
    context: bytes
    """:func:`run_context` of the run it verifies."""
    scheme: str = ED25519

    def verify(self, canonical: bytes, signature: str) -> bool:
        scheme, _, text = signature.partition(":")
        if scheme != ED25519 or len(text) != 128:
            return False  # an HMAC, or no scheme at all: never accepted where a public key is pinned
        try:
            self.public.verify(bytes.fromhex(text), self.context + canonical)
        except (InvalidSignature, ValueError):
            return False
        return True


def new_private_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def public_raw(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(Encoding.Raw, PublicFormat.Raw)


def private_text(key: Ed25519PrivateKey) -> str:
    return PRIVATE_PREFIX + key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption()).hex()


def public_text(key: Ed25519PublicKey | Ed25519PrivateKey) -> str:
    return PUBLIC_PREFIX + public_raw(public_of(key)).hex()


def public_of(key: Ed25519PublicKey | Ed25519PrivateKey) -> Ed25519PublicKey:
    return key.public_key() if isinstance(key, Ed25519PrivateKey) else key


def _raw32(text: str, what: str) -> bytes:
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"{what} must be 64 hex digits") from None
    if len(raw) != 32:
        raise ValueError(f"{what} must be 64 hex digits (32 bytes), got {len(raw)} bytes")
    return raw


def parse_key_text(text: str, *, what: str = "key") -> KeyEntry:
    """A keyring value: ``ed25519-private:<hex>``, ``ed25519-public:<hex>`` or bare hex (HMAC)."""
    text = text.strip()
    if text.startswith(PRIVATE_PREFIX):
        return Ed25519PrivateKey.from_private_bytes(_raw32(text[len(PRIVATE_PREFIX):], what))
    if text.startswith(PUBLIC_PREFIX):
        return Ed25519PublicKey.from_public_bytes(_raw32(text[len(PUBLIC_PREFIX):], what))
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"{what}: expected {PRIVATE_PREFIX}<hex>, {PUBLIC_PREFIX}<hex> or a hex HMAC key") from None


@dataclass(frozen=True)
class PinnedKeys:
    """The public keys a run pins in ``run.json`` (its ``signing`` field) at creation."""

    synchronizer: Ed25519PublicKey
    """Every commit, run.json itself, stop, retention and evaluation records and checkpoint
    configs must verify with this key."""
    learners: Mapping[str, Ed25519PublicKey]
    """Each learner's key the run was created with (a reader's own keyring entry overrides it)."""

    def to_dict(self) -> dict[str, Any]:
        return {"scheme": ED25519, "synchronizer": public_raw(self.synchronizer).hex(),
                "learners": {lid: public_raw(k).hex() for lid, k in sorted(self.learners.items())}}

    @classmethod
    def from_body(cls, body: object) -> PinnedKeys:
        """Parse ``run.json``'s ``signing`` field; ValueError if it is not one this atoll reads."""
        if not isinstance(body, Mapping) or body.get("scheme") != ED25519:
            raise ValueError(f"run.json's signing field must name scheme {ED25519!r}")
        sync, learners = body.get("synchronizer"), body.get("learners", {})
        if not isinstance(sync, str) or not isinstance(learners, Mapping):
            raise ValueError("run.json's signing field needs a synchronizer key and a learners table")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in learners.items()):
            raise ValueError("run.json's signing.learners must map learner ids to hex keys")
        return cls(Ed25519PublicKey.from_public_bytes(_raw32(sync, "signing.synchronizer")),
                   {lid: Ed25519PublicKey.from_public_bytes(_raw32(v, f"signing.learners[{lid!r}]"))
                    for lid, v in learners.items()})
