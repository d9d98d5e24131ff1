"""What can go wrong with a request, in transport-free terms.

The server maps each class to a status in one place (``server/status.py``); the engine, the
batcher and the codec raise them with a message that names the problem.
"""

from __future__ import annotations


class ServingError(Exception):
    """A request the server answers with an error; the message is for the client."""


class InputError(ServingError, ValueError):
    """A request's tensors are malformed or out of the model's range."""


class FieldError(InputError):
    """A request field (a JSON body's, or the gRPC message's it is read from) has the wrong type
    or value; ``param`` names it (OpenAI's error shape)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class InputTooLong(InputError):
    """A text (or token sequence) has more tokens than the model takes and the request did not
    ask for truncation."""


class RequestIncomplete(InputError):
    """The request's body did not arrive in full (fewer bytes than it declared, too slowly)."""


class RequestTooLarge(ServingError):
    """The request's body is over the server's size limit (gRPC refuses such messages itself)."""


class Unauthenticated(ServingError):
    """The request carries no API key, or one the server does not hold (``--api-key-file``)."""


class UnknownModel(ServingError):
    """The request names a model or version this server does not serve."""


class NotReady(ServingError):
    """The model is loading, the server is shutting down, or execution has stopped."""


class Overloaded(ServingError):
    """Too many requests are waiting or in flight; retrying later can succeed."""


class ReplyTooLarge(ServingError):
    """The answer would exceed the server's reply size limit."""


class Expired(ServingError):
    """The request's deadline passed before it could run."""
