"""What every jaxserve.v1 method does with the wire before its own work: the API key from the
`authorization: Bearer <key>` metadata, and request bytes decoded so that bytes which are no
valid message reach the method (INVALID_ARGUMENT naming the problem), not gRPC (UNKNOWN).
grpc_api.py and grpc_pooling.py share it."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from google.protobuf.message import DecodeError

from jaxserve.serving import gateway


@dataclasses.dataclass(frozen=True)
class Undecodable:
  """What a method gets for bytes that do not parse as its request message."""
  error: str


def decoder(message_type: Any) -> Callable[[bytes], Any]:
  def decode(data: bytes) -> Any:
    try:
      return message_type.FromString(data)
    except DecodeError as e:  # E.g. "String field had bad UTF-8": proto3 strings must be UTF-8.
      return Undecodable(str(e))
  return decode


def decoded(request: Any) -> Any:
  """The request message; INVALID_ARGUMENT for bytes that were none."""
  if isinstance(request, Undecodable):
    raise gateway.invalid(f"the request is not a valid message: {request.error}")
  return request


def bearer_token(metadata: Any) -> str | None:
  for key, value in metadata or ():
    if key.lower() == "authorization" and isinstance(value, str):
      scheme, _, token = value.partition(" ")
      return token.strip() if scheme.lower() == "bearer" else None
  return None
