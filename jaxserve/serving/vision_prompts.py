"""A vision-language model's prompt on the serving side: the chat-templated text's image
placeholders expanded as the model's processor expands them, and the decoded images placed at
their runs of image tokens (batching/images.py), for the engine.

Gemma 3's chat template writes one `<start_of_image>` (the VisionConfig's boi token) per image
part; `expand` turns each into the processor's sequence (blank lines, boi, the image's soft
tokens, eoi, blank lines: images.expand_text) before the text is tokenized, the token strings
taken from the tokenizer by the VisionConfig's ids. `place` then finds each image's run of image
tokens in the ids and preprocesses its pixels (a resize: it runs on the work pool, in
Service.prepare, never on the event loop).

An engine without a vision tower (vision None) leaves both as they are. A decode server of a
P/D pair refuses images: the handoff's pages are keyed by tokens only, so an image's pages would
be another image's.
"""

from __future__ import annotations

from typing import Any, Sequence

from jaxserve.batching import images as mm
from jaxserve.batching import mm_prompts
from jaxserve.serving.gateway import invalid


class VisionPrompts:

  def __init__(self, tokenizer: Any, vision: mm_prompts.Vision | None, disaggregated: bool = False):
    """`disaggregated`: this server is a P/D decode server (its prompts' KV comes from a
    prefill server), which takes no images."""
    self.vision = vision
    self.disaggregated = disaggregated
    self.markers: tuple[str, str, str] | None = None
    if vision is not None:
      ids = (vision.boi_token_id, vision.image_token_id, vision.eoi_token_id)
      self.markers = tuple(tokenizer.id_to_token(i) for i in ids)  # type: ignore[assignment]
      for token_id, token in zip(ids, self.markers):
        if tokenizer.encode(token, add_bos=False) != [token_id]:  # A mismatched tokenizer.
          raise ValueError(f"the tokenizer spells image token {token_id} {token!r}, which does "
                           "not encode back to that one id: it is not this model's tokenizer")

  def expand(self, text: str, images: Sequence[mm.Image]) -> str:
    """The chat text with each image's placeholder expanded (the text as is without images)."""
    if not images or self.vision is None:
      return text
    try:
      return mm_prompts.expand_text(text, images, self.markers, self.vision)
    except ValueError as e:  # The template wrote placeholders of its own, or too few.
      raise invalid(f"messages: {e}") from e

  def place(self, ids: Sequence[int], images: Sequence[mm.Image]) -> tuple[mm.ImageSpan, ...]:
    """Each image at its tokens in `ids`, preprocessed for the vision tower; () without images
    or without a vision tower. An INVALID_ARGUMENT when the ids hold an image cut short (a
    truncated prompt) or the server is a P/D decode server."""
    if not images or self.vision is None:
      return ()
    if self.disaggregated:
      raise invalid(f"this server is a P/D decode server, whose prompts' KV is prefilled by "
                    f"its prefill server by tokens only: a prompt with images ({len(images)}) "
                    "cannot be handed off; send it to a server without --kv-peer")
    try:
      return mm_prompts.place_images(ids, images, self.vision)
    except ValueError as e:
      raise invalid(f"prompt: {e}; an image's tokens may not be cut (truncate_prompt) and the "
                    "text may not spell image tokens itself") from e
