"""gRPC server reflection under grpc.reflection.v1 as well as v1alpha.

grpcurl and newer clients ask v1 first; grpcio-reflection serves only v1alpha. The two protos
are the same messages with the same field numbers under another package name, so the v1alpha
servicer answers v1 calls byte for byte. The v1 file is registered in the descriptor pool too
(v1alpha's with the package renamed), so that reflection can describe the v1 service it lists.
"""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2

SERVICE_NAME = "grpc.reflection.v1.ServerReflection"
_ALPHA, _V1 = "grpc.reflection.v1alpha", "grpc.reflection.v1"


def enable(service_names: tuple[str, ...], server: grpc.aio.Server) -> None:
  """Reflection for `service_names` (both reflection services are listed too), v1 and v1alpha."""
  _register_v1_file()
  names = (*service_names, reflection.SERVICE_NAME, SERVICE_NAME)
  servicer = reflection.aio.ReflectionServicer(names)
  method = grpc.stream_stream_rpc_method_handler(
      servicer.ServerReflectionInfo, reflection_pb2.ServerReflectionRequest.FromString,
      reflection_pb2.ServerReflectionResponse.SerializeToString)
  for service in (reflection.SERVICE_NAME, SERVICE_NAME):
    handlers = {"ServerReflectionInfo": method}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)


def _register_v1_file() -> None:
  pool = descriptor_pool.Default()
  try:
    pool.FindServiceByName(SERVICE_NAME)
    return  # Registered already (one per process, however many servers).
  except KeyError:
    pass
  file = descriptor_pb2.FileDescriptorProto.FromString(reflection_pb2.DESCRIPTOR.serialized_pb)
  file.name = "grpc/reflection/v1/reflection.proto"
  file.package = _V1
  file.options.Clear()  # v1alpha's language options name v1alpha packages.
  for message in file.message_type:
    for field in message.field:
      if field.type_name:  # Message fields only: setting it on a scalar field is an error.
        field.type_name = field.type_name.replace(f".{_ALPHA}.", f".{_V1}.")
  for service in file.service:
    for m in service.method:
      m.input_type = m.input_type.replace(f".{_ALPHA}.", f".{_V1}.")
      m.output_type = m.output_type.replace(f".{_ALPHA}.", f".{_V1}.")
  pool.Add(file)
