"""The committed gRPC stubs are what grpcio-tools makes of jaxserve.proto today."""

import pathlib

import pytest

PROTO = "jaxserve/api/proto/jaxserve.proto"
STUBS = ("jaxserve_pb2.py", "jaxserve_pb2.pyi", "jaxserve_pb2_grpc.py")
ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_committed_stubs_match_the_proto(tmp_path):
  protoc = pytest.importorskip("grpc_tools.protoc")
  args = ["protoc", f"-I{ROOT}", f"--python_out={tmp_path}", f"--pyi_out={tmp_path}",
          f"--grpc_python_out={tmp_path}", str(ROOT / PROTO)]
  assert protoc.main(args) == 0
  for name in STUBS:
    fresh = (tmp_path / "jaxserve" / "api" / "proto" / name).read_text()
    assert fresh == (ROOT / "jaxserve" / "api" / "proto" / name).read_text(), (
        f"{name} is stale: regenerate the stubs (see the top of {PROTO})")


def test_the_stubs_import_and_name_the_service():
  from jaxserve.api.proto import jaxserve_pb2, jaxserve_pb2_grpc

  service = jaxserve_pb2.DESCRIPTOR.services_by_name["Jaxserve"]
  assert service.full_name == "jaxserve.v1.Jaxserve"
  assert {m.name for m in service.methods} == {
      "Generate", "Tokenize", "GetModelInfo", "PrefillKV", "Embed", "Score"}
  assert hasattr(jaxserve_pb2_grpc, "JaxserveStub")
