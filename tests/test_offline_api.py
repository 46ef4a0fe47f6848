"""The offline API (jaxserve.LLM) returns what the servers return: each output token's logprobs,
equal to the gRPC server's for the same greedy request on the same engine."""

import grpc
import numpy as np
import pytest

from jaxserve.api import server
from jaxserve.config import SamplingParams
from jaxserve.llm import LLM, Loaded
from support import server_harness as h

TEXT = "Roses are red, violets are"
GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
  return LLM(str(tiny_checkpoint), engine_config=h.ENGINE)


def served(llm, request):
  """Every response to one gRPC request, from a server over the LLM's own engine."""
  cfg = server.ServerConfig(grpc_port=0, http_port=None)
  st = h.ServerThread(server.Server(lambda: Loaded(llm.engine, llm.tokenizer, "tiny"), cfg)).start()
  try:
    with grpc.insecure_channel(st.grpc_address) as channel:
      return list(h.stub(channel).Generate(request, timeout=120))
  finally:
    st.close()


def test_offline_logprobs_equal_the_grpc_servers_one_per_output_token(llm):
  (c,) = llm.generate([TEXT], SamplingParams(**GREEDY, logprobs=3))
  msgs = served(llm, h.text_request(TEXT, **GREEDY, logprobs=3))
  theirs = [lp for m in msgs for lp in m.logprobs]
  assert list(c.token_ids) == [t for m in msgs for t in m.token_ids]
  assert len(c.logprobs) == len(c.token_ids) == len(theirs) == GREEDY["max_tokens"]
  for mine, their in zip(c.logprobs, theirs):
    assert mine.top_ids == tuple(t.token_id for t in their.top)
    np.testing.assert_allclose(mine.logprob, their.logprob, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(mine.top_logprobs, [t.logprob for t in their.top], rtol=1e-6,
                               atol=1e-6)
  (plain,) = llm.generate(TEXT, SamplingParams(**GREEDY))  # Not asked: none.
  assert plain.logprobs is None and plain.token_ids == c.token_ids
