"""jaxserve.v1 gRPC messages and stubs, generated from jaxserve.proto (see its header)."""
