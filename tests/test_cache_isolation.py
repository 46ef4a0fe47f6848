"""Prefix-cache isolation (issue 29 item 4): vLLM's cache_salt, and each API key's own cache.

The attack of the issue: a tenant learns another's PIN from `cached_tokens`, since a guess that
shares more of a cached prompt reuses more of its pages. The mock server tokenizes a character a
token into 4-token pages, so the victim's "acct 7 PIN 4821 ok" fills 4 pages and a right guess
would find 16 cached tokens, a right first digit 12."""

import json

import grpc
import pytest

from jaxserve.api.proto import jaxserve_pb2 as pb
from support import mock_serving
from support import server_harness as h
from support.openai_http import call, post

VICTIM, ATTACKER = "sk-victim-0123456789", "sk-attacker-9876543210"
SECRET = "acct 7 PIN 4821 ok"
GUESSES = ("1111", "4000", "4821", "9999", "4800", "4822")


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("keys") / "keys.json"
  path.write_text(json.dumps({"keys": [{"key": VICTIM, "name": "victim"},
                                       {"key": ATTACKER, "name": "attacker"}]}))
  return str(path)


def cached(srv, prompt: str, key: str | None, **fields) -> int:
  body = {"prompt": prompt, "max_tokens": 1, **fields}
  return post(srv, body, key=key)["usage"]["prompt_tokens_details"]["cached_tokens"]


def attack(keys_file: str | None, victim_first: bool, **config) -> list[int]:
  """What the attacker's guesses see, on a fresh server; the victim's prompt cached or not."""
  srv = mock_serving.serve(keys_file=keys_file, **config)
  try:
    if victim_first:
      cached(srv, SECRET, VICTIM if keys_file else None)
    return [cached(srv, SECRET.replace("4821", g), ATTACKER if keys_file else None)
            for g in GUESSES]
  finally:
    srv.close()


def test_a_shared_cache_leaks_the_pin(keys_file):
  """What the isolation prevents: with one cache for every key, the guesses tell the PIN."""
  leaked = attack(keys_file, True, prefix_cache_scope="global")
  assert leaked != attack(keys_file, False, prefix_cache_scope="global")
  assert max(leaked) == leaked[GUESSES.index("4821")] == 16


def test_with_keys_each_keys_cache_is_its_own(keys_file):
  """The default with keys: the guesses see exactly what they would with no victim at all."""
  assert attack(keys_file, True) == attack(keys_file, False)
  assert attack(keys_file, True, prefix_cache_scope="key") == attack(keys_file, False)


def test_one_keys_requests_still_share_its_cache(keys_file):
  srv = mock_serving.serve(keys_file=keys_file)
  try:
    assert cached(srv, SECRET, VICTIM) == 0
    assert cached(srv, SECRET, VICTIM) == 16
    assert cached(srv, SECRET, ATTACKER) == 0
    # A salt of the key's own splits its cache further; no salt reaches another key's pages.
    assert cached(srv, SECRET, VICTIM, cache_salt="s") == 0
    assert cached(srv, SECRET, VICTIM, cache_salt="s") == 16
    assert cached(srv, SECRET, ATTACKER, cache_salt="s") == 0
  finally:
    srv.close()


def test_cache_salt_over_http_and_grpc_without_keys():
  srv = mock_serving.serve()
  stub = h.stub(grpc.insecure_channel(srv.grpc_address))

  def grpc_cached(**fields) -> int:
    req = pb.GenerateRequest(text=SECRET, max_tokens=1, **fields)
    return h.generate(stub, req, key=None)[-1].usage.cached_prompt_tokens

  try:
    assert cached(srv, SECRET, None, cache_salt="a") == 0
    assert cached(srv, SECRET, None, cache_salt="b") == 0
    assert cached(srv, SECRET, None) == 0
    assert grpc_cached(cache_salt="a") == 16 and grpc_cached() == 16
    assert grpc_cached(cache_salt="c") == 0
    status, body = call(srv, "/v1/completions", {"prompt": SECRET, "cache_salt": ""},
                        method="POST", key=None)
    assert status == 400 and "cache_salt must be a non-empty string" in body["error"]["message"]
    with pytest.raises(grpc.RpcError) as e:
      grpc_cached(cache_salt="")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
  finally:
    srv.close()


def test_the_scope_flag(capsys):
  from jaxserve.cli import main
  from jaxserve.serving.gateway import Gateway

  parse = lambda *extra: main._server_config(main.build_parser().parse_args(["serve", *extra]))
  assert parse("--prefix-cache-scope", "global").prefix_cache_scope == "global"
  assert parse().prefix_cache_scope is None  # "key" with --keys-file, else "global".
  assert Gateway([]).prefix_cache_scope == "key" and Gateway().prefix_cache_scope == "global"
  with pytest.raises(SystemExit):
    parse("--prefix-cache-scope", "tenant")
  assert "invalid choice: 'tenant'" in capsys.readouterr().err
  with pytest.raises(ValueError, match="prefix_cache_scope must be one of"):
    Gateway([], prefix_cache_scope="tenant")


def test_vllms_api_key_flag_is_one_admin_key_every_request_must_send(capsys):
  """`serve --api-key KEY` (vLLM's): a request without it or with another is 401 (HTTP) and
  UNAUTHENTICATED (gRPC); with it, served; the key is an admin's; not with --keys-file."""
  from jaxserve.cli import main

  config = main._server_config(main.build_parser().parse_args(["serve", "--api-key", "sk-1"]))
  assert config.api_key == "sk-1"
  with pytest.raises(ValueError, match="not both"):
    main._server_config(main.build_parser().parse_args(["serve", "--api-key", "sk-1",
                                                        "--keys-file", "keys.json"]))
  srv = mock_serving.serve(api_key="sk-1")
  try:
    body = {"prompt": "hi", "max_tokens": 1}
    assert call(srv, "/v1/completions", body, "POST", key=None)[0] == 401
    assert call(srv, "/v1/completions", body, "POST", key="sk-2")[0] == 401
    assert post(srv, body, key="sk-1")["usage"]["completion_tokens"] == 1
    request = pb.GenerateRequest(text="hi", max_tokens=1)
    with grpc.insecure_channel(srv.grpc_address) as channel:
      with pytest.raises(grpc.RpcError) as e:
        list(h.stub(channel).Generate(request, timeout=30))
      assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED
      out = list(h.stub(channel).Generate(request, metadata=(("authorization", "Bearer sk-1"),),
                                          timeout=30))
      assert out[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert [k.admin for k in srv.server.gateway.keys] == [True]
  finally:
    srv.close()


def test_jaxserve_api_key_is_the_api_key_where_no_key_flag_is_given(monkeypatch):
  """JAXSERVE_API_KEY (vLLM's VLLM_API_KEY): the --api-key of a command line with neither key
  flag; --api-key and --keys-file win over it; empty, it is unset."""
  from jaxserve.cli import main

  config = lambda *argv: main._server_config(main.build_parser().parse_args(["serve", *argv]))
  monkeypatch.setenv("JAXSERVE_API_KEY", "sk-env")
  assert config().api_key == "sk-env"
  assert config("--api-key", "sk-1").api_key == "sk-1"
  from_file = config("--keys-file", "keys.json")
  assert (from_file.api_key, from_file.keys_file) == (None, "keys.json")
  monkeypatch.setenv("JAXSERVE_API_KEY", "")
  assert config().api_key is None
