"""specd: Python client for the specd speculative-decoding server (gRPC, specd.v1.Generation).

    import specd
    with specd.Client("localhost:50051") as client:
        print(client.generate("def fib(n):", max_new_tokens=64).text)
"""

# The generated stubs (specd/v1/*_pb2.py) may live in another folder named specd on sys.path
# (the CMake build writes them to <build>/python/specd/v1): make this package span both.
import pkgutil

__path__ = pkgutil.extend_path(__path__, __name__)

from ._common import TLS, RetryPolicy  # noqa: E402
from .aio import AsyncClient  # noqa: E402
from .client import Client  # noqa: E402
from .errors import (  # noqa: E402
    AbortedError, AlreadyExistsError, CancelledError, DataLossError, DeadlineExceededError,
    FailedPreconditionError, InternalError, InvalidArgumentError, NotFoundError,
    OutOfRangeError, PermissionDeniedError, ResourceExhaustedError, SpecdError,
    UnauthenticatedError, UnavailableError, UnimplementedError, UnknownError, from_rpc_error)
from .types import Chunk, GenerateResult, ModelInfo, SpeculationStats, Usage  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "Client", "AsyncClient", "TLS", "RetryPolicy", "Chunk", "GenerateResult", "ModelInfo",
    "SpeculationStats", "Usage", "SpecdError", "AbortedError", "AlreadyExistsError",
    "CancelledError", "DataLossError", "DeadlineExceededError", "FailedPreconditionError",
    "InternalError", "InvalidArgumentError", "NotFoundError", "OutOfRangeError",
    "PermissionDeniedError", "ResourceExhaustedError", "UnauthenticatedError",
    "UnavailableError", "UnimplementedError", "UnknownError", "from_rpc_error",
]
