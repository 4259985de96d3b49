"""Exceptions raised by the Stowage client.

Every error a call can raise because of the server or the connection is a
`StowageError`. An `error` reply from `stowd` becomes the subclass for its
`code` (docs/protocol-stowage1.md, "Errors"); an unknown code is treated as
`internal`. Mistakes in the caller's arguments that are caught before anything
is sent (an empty batch, a field of the wrong type or row count, an `out`
array of the wrong shape) raise the builtin `ValueError` or `TypeError`.
"""

from __future__ import annotations


class StowageError(Exception):
    """Base class. `code` is the stowage/1 error code (None for errors raised
    by the client itself), `request_id` the id of the failed request."""

    code: str | None = None
    # put only: how many leading rows of the put were stored before the
    # failure (a put split into several messages is not atomic as a whole).
    rows_stored: int | None = None

    def __init__(self, message: str, *, code: str | None = None, request_id: int | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.request_id = request_id


class KeyNotFound(StowageError, KeyError):
    """A get named an (index, field) that is not stored (`key_not_found`)."""

    code = "key_not_found"

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.message


class DataLost(KeyNotFound):
    """A get named an (index, field) that was written or cleared after the
    checkpoint its stowd was restored from: its old value is not served, and
    the new one is gone (`data_lost`). Put it again. A `KeyNotFound`, so code
    that handles missing rows handles these too."""

    code = "data_lost"


class CapacityError(StowageError):
    """A put would exceed a unit's capacity; nothing of that message was stored (`capacity`)."""

    code = "capacity"


class BadRequest(StowageError):
    """The server refused the request as malformed (`bad_request`)."""

    code = "bad_request"


class TooLarge(BadRequest):
    """The message exceeded one of the server's limits (`too_large`)."""

    code = "too_large"


class Rejected(StowageError):
    """A policy chain with the `reject` fail strategy refused the request (`rejected`)."""

    code = "rejected"


class Unsupported(StowageError):
    """The server does not support the request, e.g. a get of a field whose rows
    mix dtypes or tensors and values (`unsupported`)."""

    code = "unsupported"


class InternalError(StowageError):
    """A failure inside the server (`internal`, or an error code this client does not know)."""

    code = "internal"


class ProtocolError(StowageError):
    """The server's reply does not follow stowage/1 (a bug on one side)."""


class StowageTimeout(StowageError, TimeoutError):
    """No reply within the timeout. The client has dropped its connection (and
    anything still queued on it) and opened a new one, so a late reply is never
    taken for the answer to a later request. The request may or may not have
    been carried out."""


_BY_CODE = {
    cls.code: cls
    for cls in (KeyNotFound, DataLost, CapacityError, BadRequest, TooLarge, Rejected, Unsupported, InternalError)
}


def error_from_reply(code: str, message: str, request_id: int | None = None) -> StowageError:
    """The exception for an `error` reply."""
    cls = _BY_CODE.get(code, InternalError)
    text = f"{code}: {message}" if cls is not InternalError or code == "internal" else f"{code} (unknown code): {message}"
    return cls(text, code=code, request_id=request_id)
