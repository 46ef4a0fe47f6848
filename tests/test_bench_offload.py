"""scripts/bench/offload.py's `offload` command (`python -m scripts.bench offload`): the chat
workload's shape and pool sizing, and a small run of both tiers, each in its fresh process, on a
tiny random model."""

import pytest

from jaxserve.loading import pull
from jaxserve.text.tokenizer import Tokenizer
from support import script_loader

offline = script_loader.load("bench.offload")


@pytest.fixture(scope="module")
def tokenizer():
  return Tokenizer.from_gguf(pull.gguf_path(pull.DEFAULT_MODEL))


def test_each_turn_extends_the_conversation_and_the_pool_is_a_quarter_of_it(tokenizer):
  chat = offline.Chat()
  messages = offline.chat_messages(tokenizer, chat)
  assert len(messages) == chat.conversations and {len(m) for m in messages} == {chat.turns}
  end_of_turn = tokenizer.encode("<|im_end|>", add_bos=False)
  for turns in messages:
    # The opening is the whole template (system prompt first); a follow-up closes the answer.
    assert tokenizer.detokenize(turns[0]).startswith("system")
    assert all(t[:len(end_of_turn)] == end_of_turn for t in turns[1:])
  assert offline.chat_messages(tokenizer, chat) == messages  # Fixed text.
  lens = offline.chat_prompt_lens(messages, chat)
  assert min(lens) > 250  # Hundreds of tokens of context by the last turn.
  num_pages, host_pages, max_len = offline.chat_pools(messages, chat)
  assert offline.chat_pool_ratio(messages, chat) >= 4
  assert max(lens) + chat.answer_tokens <= max_len and max_len <= (num_pages - 1) * chat.page_size
  assert host_pages * chat.page_size >= sum(lens)  # The host tier holds every conversation.


def test_both_tiers_run_and_the_host_tier_saves_prefill(tiny_checkpoint, capsys):
  assert offline.main_offload(["--small", "--model", str(tiny_checkpoint)]) == 0
  report = capsys.readouterr().out
  rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in report.splitlines()
          if line.startswith("| none") or line.startswith("| host")}
  none, host = int(rows["none"][1]), int(rows["host"][1])  # Prefill tokens computed.
  assert host < none and int(rows["host"][3]) > 0 == int(rows["none"][3])  # Tokens saved.
  assert "greedy answers identical: yes" in report and "none / host: prefill tokens" in report
  assert "8 conversations x 3 turns, 2 clients" in report  # --small's shape reached the children.
