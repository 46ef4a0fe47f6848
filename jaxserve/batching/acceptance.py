"""Speculative decoding's pause (speculative.py): each request measures its own acceptance and
proposes only while a verified run pays for the step it costs.

A step verifying k proposals costs `SpeculativeConfig.verify_cost` one-row decode steps
(1 + 0.15 k on CPU); it yields 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a) tokens on
average when each proposal is accepted with probability a given the ones before it. A
request estimates a from its own runs: every accepted proposal is a success, and a run that
stops at a rejected one adds one failure (the geometric distribution's estimate; a run
accepted whole stops at no rejection). The counts decay over about WINDOW runs, so the
estimate follows a request whose text turns from copying to new words and back.

Once MIN_RUNS runs are measured, a request whose runs do not pay pauses: it decodes one token
a step, as without speculation, for PAUSE_STEPS scheduler steps, twice that after its next
pause, and so on up to MAX_PAUSE_STEPS; then it probes again from a fresh measurement, so a
request that turns copy-heavy later still gains. A measurement that pays resets the pause to
PAUSE_STEPS. Shrinking k instead of pausing would save nothing: a verified chunk of fewer
proposals runs in the same k + 1 row bucket (engine/step_args.py).
"""

from __future__ import annotations

import dataclasses

WINDOW = 8  # Runs the estimate mostly remembers: each older run counts 1 - 1/WINDOW as much.
MIN_RUNS = 2  # Runs measured, from the start or a resume, before they may pause the request.
PAUSE_STEPS = 8  # The first pause; each pause in a row doubles it.
MAX_PAUSE_STEPS = 128  # The longest: a request that turns copy-heavy waits at most this long.


def expected_tokens(a: float, k: int) -> float:
  """Tokens one verified run of k proposals yields on average (the accepted ones and the
  model's next token) when each is accepted with probability a given the ones before it."""
  return k + 1.0 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


@dataclasses.dataclass
class Acceptance:
  """One request's measured acceptance and its proposing schedule."""

  num_accepted: float = 0.0  # Accepted proposals, decayed.
  num_tried: float = 0.0  # Those plus one a run that a rejection stopped, decayed.
  num_runs: int = 0  # Runs measured since the start or the last resume.
  num_pauses: int = 0  # Pauses in a row: the next one lasts PAUSE_STEPS * 2**num_pauses.
  resume_step: int = 0  # The scheduler step from which it may propose again.

  @property
  def rate(self) -> float:
    """The estimated probability that a proposal is accepted (1 before any run)."""
    return self.num_accepted / self.num_tried if self.num_tried else 1.0

  def may_propose(self, step: int) -> bool:
    return step >= self.resume_step

  def record(self, step: int, num_drafts: int, num_accepted: int, k: int, cost: float) -> None:
    """A verified run of `num_drafts` proposals came back in scheduler step `step` with
    `num_accepted` of them accepted; k and cost: SpeculativeConfig's num_speculative_tokens and
    verify_cost."""
    if not self.may_propose(step):  # Planned before the pause began: the pause stands.
      return
    decay = 1 - 1 / WINDOW
    self.num_accepted = self.num_accepted * decay + num_accepted
    self.num_tried = self.num_tried * decay + num_accepted + (num_accepted < num_drafts)
    self.num_runs += 1
    if self.num_runs < MIN_RUNS:
      return
    if expected_tokens(self.rate, k) > cost:
      self.num_pauses = 0
      return
    self.resume_step = step + min(PAUSE_STEPS << self.num_pauses, MAX_PAUSE_STEPS)
    self.num_pauses += 1
    # The probe after the pause measures afresh: the text may have changed meanwhile.
    self.num_accepted = self.num_tried = 0.0
    self.num_runs = 0
