"""A streaming gRPC client for a running `jaxserve serve`, behind `jaxserve client "prompt"`.

  with client.connect("127.0.0.1:50051") as channel:
    for msg in client.generate(channel, client.request("Hi!", max_tokens=32), api_key=None):
      print(msg.text, end="", flush=True)
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Iterator

import grpc

from jaxserve.api.proto import jaxserve_pb2 as pb
from jaxserve.api.proto import jaxserve_pb2_grpc

DEFAULT_ADDRESS = "127.0.0.1:50051"
API_KEY_ENV = "JAXSERVE_API_KEY"


def connect(address: str = DEFAULT_ADDRESS, ca_cert: str | None = None) -> grpc.Channel:
  """A channel to the server; TLS when `ca_cert` (the PEM that signed the server's cert) is set."""
  if ca_cert is None:
    return grpc.insecure_channel(address)
  with open(ca_cert, "rb") as f:
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(f.read()))


def metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
  return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def request(prompt: str, chat: bool = True, **fields: Any) -> pb.GenerateRequest:
  """A GenerateRequest for one text prompt (a one-message chat when `chat`); `fields` are any
  other GenerateRequest fields (temperature=0, max_tokens=32, stop=["\\n"], ...)."""
  if chat:
    messages = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=prompt)])
    return pb.GenerateRequest(chat=messages, **fields)
  return pb.GenerateRequest(text=prompt, **fields)


def generate(channel: grpc.Channel, req: pb.GenerateRequest, api_key: str | None = None,
             timeout: float | None = None) -> Iterator[pb.GenerateResponse]:
  """The response stream; cancel it (`.cancel()`) to abort the request on the server."""
  stub = jaxserve_pb2_grpc.JaxserveStub(channel)
  return stub.Generate(req, metadata=metadata(api_key), timeout=timeout)


def run(args, sampling: dict[str, Any]) -> int:
  """`jaxserve client`: streams one prompt's answer to stdout, its numbers to stderr.
  `sampling`: GenerateRequest's sampling fields, by SamplingParams name (the command's flags)."""
  fields = dict(sampling, chunk_tokens=args.chunk_tokens)
  api_key = args.api_key or os.environ.get(API_KEY_ENV)
  last = None
  with connect(args.address, args.ca_cert) as channel:
    try:
      for last in generate(channel, request(args.prompt, chat=not args.raw, **fields), api_key):
        print(last.text, end="", flush=True)
    except grpc.RpcError as e:
      print(f"\njaxserve client: {e.code().name}: {e.details()}", file=sys.stderr)
      return 1
  print()
  if last is not None:
    _print_summary(last)
  return 0


def _print_summary(last: pb.GenerateResponse) -> None:
  u, t = last.usage, last.timings
  reason = pb.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower()
  print(f"[{u.prompt_tokens} prompt + {u.completion_tokens} completion tokens, finish: {reason}; "
        f"first token {t.time_to_first_token * 1e3:.0f} ms (tokenize {t.tokenize * 1e3:.0f}, "
        f"queue {t.queue * 1e3:.0f}, prefill {t.prefill * 1e3:.0f}), total {t.total * 1e3:.0f} ms]",
        file=sys.stderr)


def add_parser(sub) -> None:
  """The `client` subcommand, without its sampling flags and its `run` (cli/main.py adds both)."""
  p = sub.add_parser("client", help="stream a prompt's answer from a running `jaxserve serve`",
                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("prompt")
  p.add_argument("--address", default=DEFAULT_ADDRESS, help="host:port of the gRPC API")
  p.add_argument("--api-key", default=None, help=f"API key; unset: ${API_KEY_ENV}")
  p.add_argument("--ca-cert", default=None, help="PEM CA certificate: connect with TLS")
  p.add_argument("--raw", action="store_true",
                 help="send the prompt as text, without the chat template")
  p.add_argument("--chunk-tokens", type=int, default=1, help="tokens per streamed message")
  return p
