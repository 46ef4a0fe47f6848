"""Chat templates for model files that ship without one.

A template in the model file (GGUF `tokenizer.chat_template`, `tokenizer_config.json`,
`chat_template.jinja`) always wins. Without one, a vocabulary that holds a family's turn markers
gets that family's built-in template, as llama.cpp's built-in templates do: the markers are
single tokens the model was trained on, so they name the format even where no metadata names the
model (a tokenizer-only directory).
"""

from __future__ import annotations

from typing import Callable

from absl import logging

# Gemma's turns: no system role (a system message opens the first user turn), the assistant is
# "model", and the text of each turn is trimmed, as in Google's template and llama.cpp's.
GEMMA_TURNS = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] | trim + '\\n\\n' -%}"
    "{%- set messages = messages[1:] -%}"
    "{%- else -%}{%- set system = '' -%}{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- set role = 'model' if m['role'] == 'assistant' else m['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (system if loop.first else '') + m['content'] | trim"
    " + '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)

# (markers that must all be in the vocabulary, the template they imply)
_BUILT_IN = ((("<start_of_turn>", "<end_of_turn>"), "Gemma's turn format", GEMMA_TURNS),)


def fallback(token_to_id: Callable[[str], int | None], source: str) -> str | None:
  """The built-in template the vocabulary's markers imply (None: no such markers), logged."""
  for markers, name, template in _BUILT_IN:
    if all(token_to_id(m) is not None for m in markers):
      logging.warning("%s has no chat template: using the built-in one for %s", source, name)
      return template
  return None
