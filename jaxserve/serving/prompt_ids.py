"""A request's prompt -> its token ids: text encoded, chat messages through the template (with the
tools offered), token ids checked. Whatever cannot fit the context window whatever max_tokens is
(more ids, or more characters, than the window can hold) is refused, or with `truncate` cut to its
tail, before the tokenizer spends seconds on it and before 2M ids are read one by one. How much of
the window max_tokens takes is decided later, once (client_fields.fit_to_context).

Each bad prompt is an INVALID_ARGUMENT naming the problem (gateway.ApiError).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from jaxserve.serving import client_fields
from jaxserve.serving.gateway import invalid
from jaxserve.serving.requests import Prompt
from jaxserve.text import tool_calls


class PromptEncoder:

  def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int,
               expand_images: Callable[[str, Sequence], str] | None = None):
    """`expand_images(text, images)`: a chat's text with its images' placeholders expanded
    (serving/vision_prompts.py), before it is tokenized; None: left as the template wrote it."""
    self.tokenizer = tokenizer
    self.expand_images = expand_images
    self.max_model_len = max_model_len
    self.vocab_size = vocab_size
    # Longer text cannot fit the context whatever its tokens: it is refused (or cut) before the
    # tokenizer spends seconds on it.
    self.max_prompt_chars = max_model_len * tokenizer.max_token_chars

  def encode(self, prompt: Prompt, truncate: bool = False, add_special_tokens: bool | None = None,
             add_generation_prompt: bool = True, images: Sequence = ()) -> list[int]:
    """The prompt's ids; `truncate`: text too long for the context is cut to its tail first;
    `images`: the chat's decoded images (batching.images.Image), whose placeholders a
    vision-language model's processor expands (Qwen2.5-VL's by each image's size).
    `add_special_tokens`: the BOS of text (None: the tokenizer's default; chat never: the
    template writes its own); `add_generation_prompt`: chat ends with the assistant's turn."""
    given = [x for x in (prompt.text, prompt.token_ids, prompt.messages) if x is not None]
    if len(given) != 1:
      raise invalid("prompt: give exactly one of text, token ids or chat messages")
    if prompt.token_ids is not None:
      return self._checked_ids(prompt.token_ids, truncate)
    if prompt.text is not None:
      ids = self.tokenizer.encode(self._within_reach(prompt.text, truncate), add_special_tokens)
      if prompt.text and not ids:  # "\x16": characters the vocabulary has no token for.
        raise invalid("prompt is empty once tokenized: the tokenizer drops every character of it")
      return ids
    text = self._chat_text(prompt, add_generation_prompt)
    if prompt.images and self.expand_images is not None:
      text = self.expand_images(text, images)
    return self.tokenizer.encode(self._within_reach(text, truncate), add_bos=False)

  def _chat_text(self, prompt: Prompt, add_generation_prompt: bool) -> str:
    client_fields.check_num_messages(len(prompt.messages))
    # OpenAI's new name for the system role, from either front end.
    messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in prompt.messages]
    takes_tools = self.tokenizer.takes_tools
    if prompt.tools and not takes_tools:
      messages = _offer_tools(messages, prompt.tools)
    try:
      return self.tokenizer.apply_chat_template(
          messages, add_generation_prompt, tools=prompt.tools if prompt.tools and takes_tools
          else None)
    except ValueError as e:  # It names the message and field that are wrong.
      raise invalid(str(e)) from e

  def _checked_ids(self, ids: Sequence[int], truncate: bool) -> list[int]:
    # The length first: ids that cannot fit are refused (or cut) whatever they are, and 2M ids
    # are not checked one by one first.
    room = client_fields.prompt_room(self.max_model_len)
    if len(ids) > room:
      if not truncate:
        raise invalid(
            f"prompt: {len(ids):,} token ids cannot fit in the context window of "
            f"{self.max_model_len} tokens; shorten it, or set truncate_prompt to keep its end")
      ids = ids[len(ids) - room:]
    ids = list(ids)
    client_fields.check_token_ids(ids, self.vocab_size, "prompt token_ids")
    return ids

  def _within_reach(self, text: str, truncate: bool) -> str:
    if len(text) <= self.max_prompt_chars:
      return text
    if truncate:  # The tail holds at least max_model_len tokens: all that truncation keeps.
      return text[-self.max_prompt_chars:]
    raise invalid(
        f"prompt: {len(text):,} characters cannot fit in the context window of "
        f"{self.max_model_len} tokens (at most {self.max_prompt_chars:,} characters with this "
        "tokenizer); shorten it, or set truncate_prompt to keep its end")


def _offer_tools(messages: list[Mapping[str, Any]],
                 tools: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
  """For a template that takes no tools: offered in the system message (a new one if none)."""
  offer = tool_calls.system_prompt(tools)
  if messages[0]["role"] == "system":
    content = messages[0]["content"]  # A string, or content parts (with an image).
    content = offer + "\n\n" + content if isinstance(content, str) else [
        {"type": "text", "text": offer + "\n\n"}, *content]
    return [{**messages[0], "content": content}, *messages[1:]]
  return [{"role": "system", "content": offer}, *messages]
