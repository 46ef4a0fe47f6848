"""The gateway on its own: the keys file, authentication, per-key rate limits on a fake clock, and
the checks that turn request fields into a prompt and SamplingParams."""

import hmac
import json

import pytest

from jaxserve.serving import client_fields, gateway
from jaxserve.serving.gateway import ANONYMOUS, ApiError, Gateway, Status


class Clock:
  def __init__(self):
    self.now = 1000.0

  def __call__(self):
    return self.now


def keys_file(tmp_path, entries):
  path = tmp_path / "keys.json"
  path.write_text(json.dumps({"keys": entries}))
  return path


@pytest.fixture
def keys(tmp_path):
  return gateway.load_keys(keys_file(tmp_path, [
      {"key": "sk-a", "name": "a"},
      {"key": "sk-b", "name": "b", "requests_per_minute": 3},
      {"key": "sk-c", "name": "c", "tokens_per_minute": 100},
  ]))


def status_of(fn, *args) -> ApiError:
  with pytest.raises(ApiError) as e:
    fn(*args)
  return e.value


def test_keys_file_is_read_and_the_keys_are_not_kept(keys):
  assert [(k.name, k.requests_per_minute, k.tokens_per_minute) for k in keys] == [
      ("a", 0, 0), ("b", 3, 0), ("c", 0, 100)]
  assert all("sk-" not in repr(k) and b"sk-" not in k.digest for k in keys)


@pytest.mark.parametrize("entries, named", [
    ([{"name": "x"}], "keys[0].key"),
    ([{"key": "k1", "name": "x"}, {"key": "k2"}], "keys[1].name"),
    ([{"key": "k", "name": "x", "tokens_per_minute": -1}], "keys[0].tokens_per_minute"),
    ([{"key": "k", "name": "x", "requests_per_minute": 1.5}], "keys[0].requests_per_minute"),
    ([{"key": "k", "name": "x"}, {"key": "k", "name": "y"}], "repeats a key"),
])
def test_a_bad_keys_file_names_the_entry(tmp_path, entries, named):
  with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
    gateway.load_keys(keys_file(tmp_path, entries))


def test_a_keys_file_that_is_not_json(tmp_path):
  (tmp_path / "k").write_text("sk-a a")
  with pytest.raises(ValueError, match="JSON"):
    gateway.load_keys(tmp_path / "k")


def test_authenticate(keys):
  g = Gateway(keys)
  assert g.authenticate("sk-b").name == "b"
  for wrong in (None, "", "sk-", "sk-bb", "SK-B", "sk-b "):
    assert status_of(g.authenticate, wrong).status is Status.UNAUTHENTICATED
  assert Gateway(None).authenticate(None) is ANONYMOUS


def test_authenticate_compares_every_key_even_after_a_match(keys, monkeypatch):
  calls, compare = [], hmac.compare_digest

  def counting(a, b):
    calls.append(1)
    return compare(a, b)

  monkeypatch.setattr(gateway.hmac, "compare_digest", counting)
  assert Gateway(keys).authenticate("sk-a").name == "a"  # The first key.
  assert len(calls) == 3


def test_requests_per_minute_over_a_sliding_minute(keys):
  clock = Clock()
  g = Gateway(keys, clock)
  b = g.authenticate("sk-b")
  for t in (0, 10, 20):
    clock.now = 1000 + t
    g.admit(b, 5, 5)
  clock.now = 1059
  e = status_of(g.admit, b, 5, 5)
  assert e.status is Status.RESOURCE_EXHAUSTED and "3 requests per minute" in e.message
  assert "retry in 1 s" in e.message
  clock.now = 1060  # The first request is a minute old.
  g.admit(b, 5, 5)
  g.admit(g.authenticate("sk-a"), 10**6, 10**6)  # No limits at all.


def test_tokens_per_minute_reserve_then_settle(keys):
  clock = Clock()
  g = Gateway(keys, clock)
  c = g.authenticate("sk-c")
  first = g.admit(c, 20, 50)  # Reserves 70 of 100.
  e = status_of(g.admit, c, 10, 21)  # 31 > 30 left.
  assert e.status is Status.RESOURCE_EXHAUSTED
  assert "30 of its limit of 100 tokens per minute" in e.message
  first.settle(5)  # It used 25: 75 left.
  first.settle(50)  # Only the first settle counts.
  second = g.admit(c, 10, 65)
  clock.now += 30
  third = g.admit(c, 0, 0)
  second.refund()  # Never ran: neither its tokens nor the request count.
  assert status_of(g.admit, c, 40, 36).status is Status.RESOURCE_EXHAUSTED  # 76 > 75.
  g.admit(c, 40, 35)
  clock.now += 30.5  # `first` expired, third and the last one are left: 0 + 75 used.
  assert status_of(g.admit, c, 20, 6).status is Status.RESOURCE_EXHAUSTED
  third.refund()
  g.admit(c, 20, 5)


def test_a_request_without_max_tokens_is_cut_to_the_tokens_left_not_refused(keys):
  """Defect: an unset max_tokens reserved the whole window, so a key whose limit is below it
  could never send one; the refusal named a max_tokens the client never sent."""
  g = Gateway(keys, Clock())
  c = g.authenticate("sk-c")  # 100 tokens per minute.
  lease = g.admit(c, 30, 4000, can_shorten=True)
  assert lease.max_tokens == 70  # 30 + 70 = the key's 100.
  lease.settle(10)  # 40 used: 60 left.
  assert g.admit(c, 20, 4000, can_shorten=True).max_tokens == 40
  e = status_of(g.admit, c, 5, 4000, True)
  assert e.status is Status.RESOURCE_EXHAUSTED and "max_tokens" not in e.message
  assert "0 tokens key 'c' has left" in e.message
  assert g.admit(g.authenticate("sk-a"), 30, 4000, can_shorten=True).max_tokens == 4000


def test_a_refund_after_the_minute_is_harmless(keys):
  clock = Clock()
  g = Gateway(keys, clock)
  c = g.authenticate("sk-c")
  lease = g.admit(c, 10, 10)
  clock.now += 61
  g.admit(c, 1, 1)  # Expires the old charge; charges 2 tokens.
  lease.refund()  # Its charge has left the minute already: nothing else may go with it.
  e = status_of(g.admit, c, 49, 50)  # 99 tokens: one more than the 98 left.
  assert e.status is Status.RESOURCE_EXHAUSTED and "has 98 of its limit of 100" in e.message
  assert g.admit(c, 48, 50).max_tokens == 50


def test_fit_to_context():
  ids = list(range(10))
  assert client_fields.fit_to_context(ids, None, 128, False) == (ids, 118)
  assert client_fields.fit_to_context(ids, 118, 128, False) == (ids, 118)
  e = status_of(client_fields.fit_to_context, ids, 119, 128, False)
  assert e.status is Status.INVALID_ARGUMENT and "context window of 128" in e.message
  assert client_fields.fit_to_context(ids, 120, 128, True) == (ids[2:], 120)
  assert "max_tokens" in status_of(client_fields.fit_to_context, ids, 128, 128, True).message
  assert "max_tokens" in status_of(client_fields.fit_to_context, ids, 0, 128, False).message
  assert "empty" in status_of(client_fields.fit_to_context, [], None, 128, False).message
  long = list(range(300))
  assert client_fields.fit_to_context(long, None, 128, True) == (long[-127:], 1)
  # Completions' default of 16 tokens.
  assert client_fields.fit_to_context(ids, None, 128, False, default=16) == (ids, 16)
  assert client_fields.fit_to_context(list(range(120)), None, 128, False, default=16)[1] == 8


def test_sampling_params():
  sp = client_fields.sampling_params({"temperature": 0.5, "stop": ["x"]}, 7, None)
  assert (sp.temperature, sp.stop, sp.max_tokens, sp.logprobs) == (0.5, ("x",), 7, 0)
  # The chosen token's logprob needs a top row.
  assert client_fields.sampling_params({}, 1, 0).logprobs == 1
  assert client_fields.sampling_params({}, 1, 20).logprobs == 20
  for fields, logprobs, named in [({"temprature": 1.0}, None, "temprature"),
                                  ({"top_p": 2.0}, None, "top_p"),
                                  ({"top_k": "5"}, None, "top_k"),
                                  ({"stop": "x"}, None, "stop"),
                                  ({}, 21, "logprobs"), ({}, -1, "logprobs"),
                                  ({}, True, "logprobs")]:
    e = status_of(client_fields.sampling_params, fields, 4, logprobs)
    assert e.status is Status.INVALID_ARGUMENT and named in e.message


def test_token_ids_and_chunk_tokens():
  client_fields.check_token_ids([0, 5, 9], 10, "ids")
  for bad in ([10], [-1], [True], [1.0]):
    assert "ids[0]" in status_of(client_fields.check_token_ids, bad, 10, "ids").message
  assert client_fields.check_chunk_tokens(0) == client_fields.check_chunk_tokens(1) == 1
  assert client_fields.check_chunk_tokens(8) == 8
  assert "chunk_tokens" in status_of(client_fields.check_chunk_tokens, -1).message
