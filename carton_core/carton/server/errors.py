"""The model server's exceptions, and the one table of what each is answered with over HTTP and gRPC.

    ServerError                 the model server refused a request (500, INTERNAL)
    ├── BadRequest              a request is malformed: body, header, tensor data, names (400, INVALID_ARGUMENT)
    │   └── RequestTooLarge     a request body is over the server's size limit (413, RESOURCE_EXHAUSTED)
    ├── ModelNotFound           no such model, or no ready version of it (404, NOT_FOUND)
    ├── ModelUnavailable        the model timed out or went away under a request; retrying may work (503, UNAVAILABLE)
    └── RepositoryError         a repository load or unload failed: config, files, carton, timeout (400,
        │                       INVALID_ARGUMENT)
        └── UploadDisabled      a load sent `file:` payloads to a server started with uploads off (403,
                                PERMISSION_DENIED)

Every one is a `carton.CartonError` and importable from `carton` too (``carton.BadRequest``). The gRPC codes are
`grpc.StatusCode` member names, so this module needs no gRPC: `carton.server._grpc` turns them into codes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import CartonError

__all__ = [
    "STATUS",
    "BadRequest",
    "ModelNotFound",
    "ModelUnavailable",
    "RepositoryError",
    "RequestTooLarge",
    "ServerError",
    "Status",
    "UploadDisabled",
    "status_of",
]


class ServerError(CartonError):
    """The model server refused a request; `http_status` and `grpc_status` say how it is answered (`STATUS`)."""

    @property
    def http_status(self) -> int:
        """The HTTP status this error is answered with."""
        return status_of(self).http

    @property
    def grpc_status(self) -> str:
        """The `grpc.StatusCode` member name this error is answered with."""
        return status_of(self).grpc


class BadRequest(ServerError):
    """A request is malformed (body, header, tensor data, model name); names the field or tensor at fault."""


class RequestTooLarge(BadRequest):
    """A request body is larger than the server's configured limit."""


class ModelNotFound(ServerError):
    """The model does not exist, or has no ready version (not loaded, loading, or being unloaded)."""


class ModelUnavailable(ServerError):
    """The model could not answer this request in time, or went away under it; retrying may succeed.

    Answered like Triton's ``UNAVAILABLE`` errors (its request timeouts among them): HTTP 503, gRPC UNAVAILABLE.
    """


class RepositoryError(ServerError):
    """A repository load or unload failed: bad config, bad `file:` payload, invalid carton, or a load timeout."""


class UploadDisabled(RepositoryError):
    """A load sent `file:` payloads to a server started with model upload disabled."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Status:
    """How an error is answered: an HTTP status and a gRPC status code (a `grpc.StatusCode` member name)."""

    http: int
    grpc: str


#: What each error is answered with, chosen as Triton answers the same failures (a subclass not listed here is
#: answered as its nearest listed base). gRPC codes are chosen per error, not derived from the HTTP status.
STATUS: Mapping[type[ServerError], Status] = {
    ServerError: Status(http=500, grpc="INTERNAL"),
    BadRequest: Status(http=400, grpc="INVALID_ARGUMENT"),
    RequestTooLarge: Status(http=413, grpc="RESOURCE_EXHAUSTED"),
    ModelNotFound: Status(http=404, grpc="NOT_FOUND"),
    ModelUnavailable: Status(http=503, grpc="UNAVAILABLE"),
    RepositoryError: Status(http=400, grpc="INVALID_ARGUMENT"),
    UploadDisabled: Status(http=403, grpc="PERMISSION_DENIED"),
}


def status_of(error: ServerError) -> Status:
    """How `error` is answered: the `STATUS` entry of its class or its nearest base."""
    for cls in type(error).__mro__:
        status = STATUS.get(cls)
        if status is not None:
            return status
    return STATUS[ServerError]
