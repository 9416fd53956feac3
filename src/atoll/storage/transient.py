"""Which storage errors are worth retrying: by exception type, HTTP status and S3 error code.

Never by message text. The storage clients' exception classes are looked up among the modules
already imported, so the storage layer needs none of those clients installed.
"""

from __future__ import annotations

import errno
import sys

from atoll.storage.validation import StorageError

__all__ = ["is_transient"]

_TRANSIENT_CODES = frozenset({
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "RequestTimeout",
    "RequestTimeTooSkewed",  # botocore corrects its clock offset on the next attempt
    "InternalError",
    "ServiceUnavailable",
    "TooManyRequests",
})
"""S3 error codes (botocore ``ClientError.response["Error"]["Code"]``) worth retrying."""

_TRANSIENT_CLASSES = (
    # botocore: no connection, connection dropped or timed out, body cut short.
    ("botocore.exceptions", ("ConnectionError", "HTTPClientError", "IncompleteReadError")),
    # aiohttp (under s3fs and gcsfs): connection refused/reset/closed, server timeout, short body.
    ("aiohttp.client_exceptions", ("ClientConnectionError", "ClientPayloadError")),
    # requests: gcsfs raises requests' ProxyError for an HTTP 502.
    ("requests.exceptions", ("ConnectionError", "Timeout", "ChunkedEncodingError")),
    ("fsspec.exceptions", ("FSTimeoutError",)),
    # gcsfs: the body's md5 did not match (a corrupted transfer; gcsfs itself retries it).
    ("gcsfs.retry", ("ChecksumError",)),
)
"""Exception classes of the storage clients that mean "try again", by module and class name.

They are looked up in ``sys.modules`` only: an exception of a class whose module was never
imported cannot exist, so the storage layer needs none of these clients installed."""

_TRANSIENT_ERRNOS = frozenset({
    errno.ECONNRESET,
    errno.ECONNABORTED,
    errno.ECONNREFUSED,
    errno.ETIMEDOUT,
    errno.EPIPE,
    errno.EAGAIN,
    errno.EBUSY,  # s3fs's translation of 503 / SlowDown / ServiceUnavailable / 409
    getattr(errno, "EREMOTEIO", errno.EIO),  # s3fs's translation of 500 / InternalError
})

_NOT_TRANSIENT = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError,
                  StorageError, ValueError, KeyError, TypeError)


def _transient_status(status: object) -> bool:
    """HTTP status codes worth retrying: 408 request timeout, 429 too many requests, any 5xx."""
    return isinstance(status, int) and not isinstance(status, bool) and (status >= 500 or status in (408, 429))


def _loaded_classes(module: str, names: tuple[str, ...]) -> tuple[type, ...]:
    mod = sys.modules.get(module)
    if mod is None:
        return ()
    return tuple(c for n in names if isinstance(c := getattr(mod, n, None), type))


def _client_class(module: str, name: str) -> type | None:
    found = _loaded_classes(module, (name,))
    return found[0] if found else None


def _http_status_transient(e: BaseException) -> bool:
    """The HTTP status (or S3 error code) that a storage client's exception carries."""
    http_error = _client_class("gcsfs.retry", "HttpError")  # gcsfs: HttpError({"code": status, ...})
    if http_error is not None and isinstance(e, http_error):
        return _transient_status(getattr(e, "code", None))
    client_error = _client_class("botocore.exceptions", "ClientError")  # botocore: parsed S3 response
    if client_error is not None and isinstance(e, client_error):
        response = getattr(e, "response", None) or {}
        err = response.get("Error", {}) or {}
        status = (response.get("ResponseMetadata", {}) or {}).get("HTTPStatusCode")
        return err.get("Code") in _TRANSIENT_CODES or _transient_status(status)
    response_error = _client_class("aiohttp.client_exceptions", "ClientResponseError")
    if response_error is not None and isinstance(e, response_error):
        return _transient_status(getattr(e, "status", None))
    return False


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception in its cause/context chain) is worth retrying.

    Keyed on exception types, HTTP status codes and S3 error codes, never on message text:
    builtin ``ConnectionError`` / ``TimeoutError``; the connection and timeout classes of botocore,
    aiohttp, requests and fsspec; gcsfs ``HttpError`` and botocore ``ClientError`` with status 408,
    429 or 5xx (or a throttling S3 code); and the errnos s3fs translates those into (EBUSY for
    503/SlowDown, EREMOTEIO for 500). Missing, existing, forbidden and malformed are never
    transient. s3fs keeps the botocore error as ``__cause__`` of its OSError, so the chain is walked.
    """
    transient_classes = tuple(c for module, names in _TRANSIENT_CLASSES for c in _loaded_classes(module, names))
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, _NOT_TRANSIENT):
            return False
        if isinstance(e, ConnectionError | TimeoutError) or isinstance(e, transient_classes):
            return True
        if _http_status_transient(e):
            return True
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
            return True
        e = e.__cause__ or e.__context__
    return False
