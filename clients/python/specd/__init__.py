"""specd: Python client for the specd speculative-decoding server (gRPC, specd.v1.Generation).

    import specd
    with specd.Client("localhost:50050") as client:
        print(client.generate("def fib(n):", max_new_tokens=64).text)
"""

from ._common import TLS, RetryPolicy
from .aio import AsyncClient
from .client import Client
from .errors import (
    AbortedError, AlreadyExistsError, CancelledError, DataLossError, DeadlineExceededError,
    FailedPreconditionError, InternalError, InvalidArgumentError, NotFoundError,
    OutOfRangeError, PermissionDeniedError, ResourceExhaustedError, SpecdError,
    UnauthenticatedError, UnavailableError, UnimplementedError, UnknownError, from_rpc_error)
from .types import (Chunk, GenerateResult, ModelInfo, SpeculationStats, TokenLogprob,
                    TopLogprob, Usage)

__version__ = "0.1.0"

__all__ = [
    "Client", "AsyncClient", "TLS", "RetryPolicy", "Chunk", "GenerateResult", "ModelInfo",
    "SpeculationStats", "TokenLogprob", "TopLogprob", "Usage", "SpecdError", "AbortedError", "AlreadyExistsError",
    "CancelledError", "DataLossError", "DeadlineExceededError", "FailedPreconditionError",
    "InternalError", "InvalidArgumentError", "NotFoundError", "OutOfRangeError",
    "PermissionDeniedError", "ResourceExhaustedError", "UnauthenticatedError",
    "UnavailableError", "UnimplementedError", "UnknownError", "from_rpc_error",
]
