"""Typed exceptions, one per gRPC status code the router answers with."""

import grpc


class SpecdError(Exception):
    """A failed call. `code` is the grpc.StatusCode, `details` the server's message (for
    INVALID_ARGUMENT it names the request field)."""

    code = grpc.StatusCode.UNKNOWN

    def __init__(self, details="", code=None, debug_error_string=None):
        super().__init__(details)
        if code is not None:
            self.code = code
        self.details = details
        self.debug_error_string = debug_error_string

    def __str__(self):
        return f"{self.code.name}: {self.details}"


class CancelledError(SpecdError):
    code = grpc.StatusCode.CANCELLED


class UnknownError(SpecdError):
    code = grpc.StatusCode.UNKNOWN


class InvalidArgumentError(SpecdError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceededError(SpecdError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFoundError(SpecdError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExistsError(SpecdError):
    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDeniedError(SpecdError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhaustedError(SpecdError):
    """The router's queue is full (backpressure): retry later, with backoff."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPreconditionError(SpecdError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class AbortedError(SpecdError):
    code = grpc.StatusCode.ABORTED


class OutOfRangeError(SpecdError):
    code = grpc.StatusCode.OUT_OF_RANGE


class UnimplementedError(SpecdError):
    code = grpc.StatusCode.UNIMPLEMENTED


class InternalError(SpecdError):
    code = grpc.StatusCode.INTERNAL


class UnavailableError(SpecdError):
    code = grpc.StatusCode.UNAVAILABLE


class DataLossError(SpecdError):
    code = grpc.StatusCode.DATA_LOSS


class UnauthenticatedError(SpecdError):
    code = grpc.StatusCode.UNAUTHENTICATED


_BY_CODE = {cls.code: cls for cls in SpecdError.__subclasses__()}


def from_rpc_error(error):
    """The typed exception for a grpc.RpcError (sync) or grpc.aio.AioRpcError."""
    code = error.code() if callable(getattr(error, "code", None)) else grpc.StatusCode.UNKNOWN
    details = error.details() if callable(getattr(error, "details", None)) else str(error)
    debug = error.debug_error_string() if callable(
        getattr(error, "debug_error_string", None)) else None
    cls = _BY_CODE.get(code, SpecdError)
    return cls(details or "", code=code, debug_error_string=debug)
