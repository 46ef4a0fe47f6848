"""The OpenAI-compatible HTTP port from a test: the official client, and plain requests."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import openai

from support.server_harness import KEYS


def openai_client(srv, key: str = "alice", timeout: float = 60) -> openai.OpenAI:
  """The official client as `key` (a name in KEYS, or any other string sent as it is)."""
  return openai.OpenAI(base_url=srv.http_url + "/v1", api_key=KEYS.get(key, key), max_retries=0,
                       timeout=timeout)


def call(srv, path: str, body: Any = None, method: str | None = None, key: str | None = "alice",
         timeout: float = 60) -> tuple[int, Any]:
  """(status, body) of one request to `path`: the body parsed as JSON, a stream's list of events,
  or the raw text; `key` None sends no Authorization header."""
  data = None if body is None else json.dumps(body).encode()
  headers = {"Authorization": f"Bearer {KEYS.get(key, key)}"} if key else {}
  req = urllib.request.Request(srv.http_url + path, data=data, method=method, headers=headers)
  try:
    with urllib.request.urlopen(req, timeout=timeout) as r:
      status, raw = r.status, r.read().decode()
  except urllib.error.HTTPError as e:
    status, raw = e.code, e.read().decode()
  if isinstance(body, dict) and body.get("stream"):
    events = [line[6:] for line in raw.split("\n\n") if line.startswith("data: {")]
    return status, [json.loads(event) for event in events]
  try:
    return status, json.loads(raw)
  except ValueError:
    return status, raw


def post(srv, body: Any, path: str = "/v1/completions", **kw) -> Any:
  """The body of a POST that must succeed."""
  status, out = call(srv, path, body, method="POST", **kw)
  assert status == 200, (status, out)
  return out
