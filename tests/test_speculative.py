"""Speculative decoding (n-gram proposals, greedy verification) on the default model: the same
tokens as without it, alone, batched and preempted; stops, max_tokens and logprobs inside a
verified run; no compile after warm-up. One engine with speculation on serves both sides: a
request with SamplingParams(speculative=False) decodes one token a step as without it."""

import dataclasses

import numpy as np
import pytest

from jaxserve.batching.plan import StepKind
from jaxserve.batching.runner import Runner
from jaxserve.batching.speculative import propose_ngram
from jaxserve.config import EngineConfig, SamplingParams, SchedulerConfig, SpeculativeConfig
from support import speculation
from support.speculation import run, tokens
from support.tiny import count_compiles

K = 4
ENGINE = EngineConfig(num_slots=4, page_size=16, num_pages=24, max_model_len=368,
                      prefill_buckets=(32,),
                      speculative=SpeculativeConfig(num_speculative_tokens=K))
TEXTS = [
    "Repeat this list exactly: apples, bananas, cherries, dates, elderberries, figs, grapes.\n"
    "List: apples, bananas,",
    "def add(a, b):\n    return a + b\n\n# The same function, renamed to plus:\ndef plus(a, b):\n",
    "Extract the name field.\nRecord: name=Alice Smith, age=41, city=Paris\nname=",
    "What is a mortgage rate?",
]


@pytest.fixture(scope="module")
def engine(default_model):
  return speculation.warm_engine(default_model, ENGINE)


@pytest.fixture(scope="module")
def prompts(default_model):
  return [default_model[1].encode(t) for t in TEXTS]


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_tokens_equal_without_speculation_alone_and_batched(engine, default_model,
                                                                   prompts, k):
  tok = default_model[1]
  on = SamplingParams(temperature=0, max_tokens=48)
  off = dataclasses.replace(on, speculative=False)
  with count_compiles() as counts:
    for batch in ([prompts[0]], prompts):
      want, s_off = run(engine, tok, batch, off, k)
      got, s_on = run(engine, tok, batch, on, k)
      assert tokens(got) == tokens(want)
      assert s_off.spec_stats.num_draft_tokens == 0
      assert s_on.spec_stats.num_accepted_tokens > 0  # It did speculate, and it paid.
      assert sum(c.num_accepted_tokens for c in got) == s_on.spec_stats.num_accepted_tokens
      assert max(s_on.spec_stats.accepted_per_pos[k:], default=0) == 0
  assert counts == {"trace": 0, "compile": 0}


def test_greedy_tokens_equal_when_preempted(engine, default_model, prompts):
  """23 pages of 16 tokens cannot hold four 160-token sequences: requests are preempted and
  recomputed, verified runs in flight included."""
  on = SamplingParams(temperature=0, max_tokens=130, ignore_eos=True)
  want, s_off = run(engine, default_model[1], prompts, dataclasses.replace(on, speculative=False))
  got, s_on = run(engine, default_model[1], prompts, on)
  assert s_off.num_preemptions > 0 and s_on.num_preemptions > 0
  assert s_on.spec_stats.num_accepted_tokens > 0
  assert tokens(got) == tokens(want)
  assert s_on.pages.num_free_pages == s_on.pages.num_usable_pages  # Every page came back.


def test_a_request_verifies_in_consecutive_steps_and_sits_none_out(engine, default_model,
                                                                   prompts):
  """The step reads a verified chunk's first token and position from the slot's decode state,
  so a request verifies again in the step after its run, before the host has the run's tokens.
  Alone, it is in every plan from its prompt's last chunk to its end: no step waits for it."""
  tok = default_model[1]
  on = SamplingParams(temperature=0, max_tokens=48)
  want, _ = run(engine, tok, prompts[:1], dataclasses.replace(on, speculative=False))
  runner = Runner(engine, tok)
  steps, schedule = [], runner.scheduler.schedule

  def recorded(*args, **options):
    steps.append(schedule(*args, **options))
    return steps[-1]
  runner.scheduler.schedule = recorded
  got = runner.generate([(prompts[0], on)])
  assert tokens(got) == tokens(want)
  verified = [any(ch.num_drafts for ch in s.plan.prefills) for s in steps]
  assert any(a and b for a, b in zip(verified, verified[1:]))
  busy = [not s.plan.is_empty for s in steps]
  last = max(i for i, b in enumerate(busy) if b)
  assert all(busy[:last + 1]), busy


def test_greedy_tokens_equal_while_proposals_pause_and_resume(engine, default_model, prompts):
  """A verify_cost no run can pay for (k + 1 tokens at best): each request pauses after every
  measurement and probes again after its back-off (batching/acceptance.py), with runs in
  flight across each switch; the tokens are those of no speculation, and nothing compiles."""
  tok = default_model[1]
  on = SamplingParams(temperature=0, max_tokens=48)
  want, _ = run(engine, tok, prompts[:2], dataclasses.replace(on, speculative=False))
  runner = Runner(engine, tok)
  runner.scheduler.speculative = dataclasses.replace(engine.info.speculative, verify_cost=K + 1)
  verified, schedule = [], runner.scheduler.schedule

  def recorded(*args, **options):
    step = schedule(*args, **options)
    verified.append({ch.request_id for ch in step.plan.prefills if ch.num_drafts})
    return step
  runner.scheduler.schedule = recorded
  with count_compiles() as counts:
    got = runner.generate([(p, on) for p in prompts[:2]])
  assert tokens(got) == tokens(want)
  assert counts == {"trace": 0, "compile": 0}
  # Some request verified, paused (planned steps without a run), then verified again.
  for rid in {rid for ids in verified for rid in ids}:
    steps = [i for i, ids in enumerate(verified) if rid in ids]
    if any(b - a > 2 for a, b in zip(steps, steps[1:])):
      break
  else:
    raise AssertionError(f"no request paused and resumed: {verified}")
  assert runner.scheduler.spec_stats.num_draft_tokens > 0


def test_no_proposals_while_the_batch_is_larger_than_disable_by_batch_size(engine,
                                                                           default_model, prompts):
  """SpeculativeConfig.disable_by_batch_size: a step plans no verified chunk while more
  requests run than it allows; with fewer the requests speculate; the tokens are unchanged."""
  tok = default_model[1]
  on = SamplingParams(temperature=0, max_tokens=48)
  want, _ = run(engine, tok, prompts, dataclasses.replace(on, speculative=False))
  runner = Runner(engine, tok)
  runner.scheduler.speculative = dataclasses.replace(ENGINE.speculative, disable_by_batch_size=2)
  seen, schedule = [], runner.scheduler.schedule

  def recorded(*args, **options):
    num_running = len(runner.scheduler.running)
    step = schedule(*args, **options)
    seen.append((num_running, sum(ch.num_drafts > 0 for ch in step.plan.prefills)))
    return step
  runner.scheduler.schedule = recorded
  got = runner.generate([(p, on) for p in prompts])
  assert tokens(got) == tokens(want)
  assert all(n <= 2 for n, verified in seen if verified)
  assert any(verified for _, verified in seen) and max(n for n, _ in seen) == len(prompts)
  with pytest.raises(ValueError, match="disable_by_batch_size"):
    SpeculativeConfig(disable_by_batch_size=0)


def test_disable_by_batch_size_auto_is_the_platforms(engine):
  """The default, "auto", is resolved by the engine for its platform: a limit on CPU (where a
  step's cost grows with its rows), none on TPU and GPU; a number or None is kept as given."""
  from jaxserve.config.speculative import CPU_DISABLE_BY_BATCH_SIZE
  auto = SpeculativeConfig()
  assert auto.disable_by_batch_size == "auto" and auto.max_batch_size is None
  assert auto.resolved("cpu").max_batch_size == CPU_DISABLE_BY_BATCH_SIZE
  assert auto.resolved("tpu").disable_by_batch_size is None
  assert auto.resolved("gpu").disable_by_batch_size is None
  for size in (None, 2, 64):
    assert SpeculativeConfig(disable_by_batch_size=size).resolved("cpu").disable_by_batch_size \
        == size
  assert SpeculativeConfig.from_json('{"disable_by_batch_size": null}').max_batch_size is None
  assert engine.info.speculative.disable_by_batch_size == CPU_DISABLE_BY_BATCH_SIZE
  with pytest.raises(ValueError, match="disable_by_batch_size"):
    SpeculativeConfig(disable_by_batch_size="always")


def test_max_tokens_stops_and_logprobs_inside_verified_runs(engine, default_model, prompts):
  tok = default_model[1]
  base = SamplingParams(temperature=0, max_tokens=40, logprobs=2)
  want, _ = run(engine, tok, prompts[:1], dataclasses.replace(base, speculative=False))
  ids, text = list(want[0].token_ids), want[0].text
  cases = [dict(max_tokens=n) for n in range(1, 12)] + [
      dict(stop_token_ids=[ids[9]]), dict(stop=[text[20:26]]), dict(stop=[text[31:33]])]
  for case in cases:
    on = dataclasses.replace(base, **case)
    off, = run(engine, tok, prompts[:1], dataclasses.replace(on, speculative=False))[0]
    got, = run(engine, tok, prompts[:1], on)[0]
    assert list(got.token_ids) == list(off.token_ids), case
    assert (got.text, got.finish_reason, got.stop_reason) == (
        off.text, off.finish_reason, off.stop_reason), case
    assert len(got.token_ids) <= on.max_tokens
    assert len(got.logprobs) == len(got.token_ids)
    for a, b in zip(got.logprobs, off.logprobs):
      assert a.top_ids == b.top_ids, case
      np.testing.assert_allclose([a.logprob, *a.top_logprobs], [b.logprob, *b.top_logprobs],
                                 atol=2e-3)
    assert got.num_accepted_tokens > 0 or len(got.token_ids) <= 2, case


def test_sampled_tokens_equal_without_speculation_with_every_setting(engine, default_model,
                                                                     prompts):
  """The sampler's noise depends only on (seed, position), so a sampled request's verified run
  is the tokens it would have sampled one at a time: filters, penalties (counting the proposals
  before each position), bias and seeds alike."""
  tok = default_model[1]
  settings = [dict(temperature=1.0), dict(temperature=0.7, top_k=40, top_p=0.9, min_p=0.02),
              # Mild penalties: strong ones stop the copying that proposals come from.
              dict(temperature=0.8, repetition_penalty=1.05, presence_penalty=0.1,
                   frequency_penalty=0.1),
              dict(temperature=0, repetition_penalty=1.05, logit_bias={11: 3.0})]
  for i, case in enumerate(settings):
    on = SamplingParams(max_tokens=40, seed=100 + i, **case)
    want, _ = run(engine, tok, prompts, dataclasses.replace(on, speculative=False))
    got, s_on = run(engine, tok, prompts, on)
    assert tokens(got) == tokens(want), case
    assert s_on.spec_stats.num_draft_tokens > 0, case


def test_sampled_distribution_matches_without_speculation(engine, default_model, prompts):
  """Temperature 1, 48 draws a side with different seeds (so not the same draws): a
  chi-square test of the second and third tokens (the first verified ones) against no
  speculation."""
  from scipy import stats
  tok, n = default_model[1], 48
  runner = Runner(engine, tok)
  draws = [(prompts[0], SamplingParams(temperature=1.0, max_tokens=3, seed=i)) for i in range(n)]
  with_spec = runner.generate(draws)
  assert runner.scheduler.spec_stats.num_draft_tokens > 0
  without = Runner(engine, tok).generate(
      [(p, dataclasses.replace(sp, seed=1000 + sp.seed, speculative=False)) for p, sp in draws])
  a = [tuple(c.token_ids[1:3]) for c in with_spec]
  b = [tuple(c.token_ids[1:3]) for c in without]
  kinds = sorted(set(a) | set(b))
  table = np.array([[a.count(x) for x in kinds], [b.count(x) for x in kinds]])
  assert len(kinds) > 1  # Temperature 1 draws more than one continuation.
  assert stats.chi2_contingency(table).pvalue > 1e-3, table


def test_propose_ngram_takes_the_longest_latest_match():
  spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=3)
  # The last 3 tokens (7, 8, 9) occurred at 1..3 (then 4, 5): the 3-gram wins over the 2-gram
  # (8, 9), which occurred later, at 6..7 (then 1).
  assert propose_ngram([0, 7, 8, 9, 4, 5, 8, 9, 1, 7, 8, 9], spec, 10) == [4, 5, 8]
  assert propose_ngram([0, 7, 8, 9, 4, 5, 8, 9, 1, 7, 8, 9], spec, 2) == [4, 5]
  assert propose_ngram([1, 2, 3, 1, 2], spec, 10) == [3, 1, 2]
  assert propose_ngram([1, 2, 3, 4, 5], spec, 10) == []  # No bigram recurs.
  assert propose_ngram([5, 5], spec, 10) == []  # Too short to match min 2 before the suffix.
  # (5, 5) at 0..1, then 5: a continuation past the end repeats itself (a period of 1).
  assert propose_ngram([5, 5, 5], spec, 10) == [5, 5, 5]


def test_propose_ngram_repeats_a_continuation_that_reaches_the_end():
  """Text that repeats a short span gets k proposals, the span's period over and over, where
  the latest match leaves fewer than k tokens before the end."""
  spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=2)
  # (1, 2) last occurred 3 tokens back (at 3..4): what followed is 3, 1, 2, then it repeats.
  assert propose_ngram([1, 2, 3, 1, 2, 3, 1, 2], spec, 10) == [3, 1, 2, 3]
  assert propose_ngram([1, 2, 3, 1, 2, 3, 1, 2], spec, 10, ahead=1) == [3, 1, 2, 3, 1]
  assert propose_ngram([9, 4, 4, 4], spec, 2) == [4, 4]
  # A match with k tokens after it before the end is unchanged: the tokens that followed it.
  assert propose_ngram([1, 2, 7, 8, 9, 6, 5, 1, 2], spec, 10) == [7, 8, 9, 6]


def test_speculative_config_json_and_errors():
  c = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 3, '
                                  '"prompt_lookup_min": 1, "prompt_lookup_max": 5}')
  assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (3, 1, 5)
  for text, words in [('{"method": "eagle"}', "method"), ('{"num_spec": 2}', "unknown keys"),
                      ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
                      ('{"prompt_lookup_min": 5, "prompt_lookup_max": 2}', "prompt_lookup_min"),
                      ("[4]", "JSON object"), ("{4", "not valid JSON"),
                      ('{"draft_model": "x"}', "draft")]:
    with pytest.raises(ValueError, match=words):
      SpeculativeConfig.from_json(text)
  with pytest.raises(ValueError, match="speculative"):
    SamplingParams(speculative=1)


def test_verified_programs_are_warmup_programs():
  """plan --compile and warm-up share assembly.programs(): the verifying variant is among them
  with speculation on (one per step shape with prefill), and absent without it."""
  from jaxserve.engine.step_args import Packer
  on, off = Packer(ENGINE, 128, None), Packer(dataclasses.replace(ENGINE, speculative=None), 128,
                                               None)
  assert off.verified_shapes() == []
  assert on.verify_buckets() == (5, 20)  # A run of k + 1 = 5 tokens; 4 of them (max_prefill_seqs).
  assert on.verified_shapes() == [s for s in on.shapes() if s.prefill_tokens] + [
      (d, t, on.width) for d in (0, 4) for t in (5, 20)]
  args = on.template(on.verified_shapes()[0], StepKind.VERIFYING)
  assert args.verify_rows.shape == (args.prefill_slots.shape[0], K + 1)
  assert args.verify_drafts.shape == (args.prefill_slots.shape[0], K)


def test_verify_buckets_attend_in_blocks_of_k_plus_1_one_a_chunk():
  """A step of verified chunks alone attends in one block of k + 1 rows per chunk (a block as
  wide as the bucket attended with 4x the rows); a prompt's chunk keeps blocks of up to 64."""
  from jaxserve.batching.plan import PrefillChunk, StepPlan
  from jaxserve.engine.step_args import Packer
  packer = Packer(ENGINE, 128, None)
  chunk = lambda slot, n, d: PrefillChunk(f"r{slot}", slot, list(range(1, n + 1)), 40, [1, 2, 3, 4],
                                          True, SamplingParams(temperature=0), 0, num_drafts=d)
  args, _ = packer.pack(StepPlan(prefills=[chunk(s, K + 1, K) for s in range(4)]))
  assert args.prefill_tokens.shape == (20,) and args.block_rows.shape == (4, K + 1)
  assert args.block_rows.tolist() == [list(range(5 * j, 5 * j + 5)) for j in range(4)]
  args, _ = packer.pack(StepPlan(prefills=[chunk(0, 2, 1), chunk(1, 3, 2)]))  # Bucket 5.
  assert args.block_rows.tolist() == [[0, 1, 5, 5, 5], [2, 3, 4, 5, 5], [5] * 5, [5] * 5]
  args, _ = packer.pack(StepPlan(prefills=[chunk(0, 20, 0)]))  # A prompt: the prefill bucket.
  assert args.block_rows.shape == (4, 32)


def test_a_verifying_step_runs_the_head_once(engine):
  """The verifying program's one matmul into the vocabulary serves its decode rows, prompts and
  verified positions alike (a second over every sequence's last row cost a 5-row head as much
  again at one slot, on CPU)."""
  V = engine.model_config.vocab_size
  for shape in (engine.packer.verified_shapes()[0], engine.packer.verified_shapes()[-1]):
    args = engine.packer.template(shape, StepKind.VERIFYING)
    text = engine._steps[StepKind.VERIFYING].lower(engine.params, engine.cache, engine.state, args,
                                     engine.stop_ids).as_text()
    heads = [line for line in text.splitlines()
             if "dot_general" in line and f"x{V}xf32>" in line.split("->")[-1]]
    assert len(heads) == 1, heads


def test_speculative_config_flag_on_serve_generate_and_plan(capsys):
  from jaxserve.cli import flags
  from jaxserve.cli import main as cli
  text = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}'
  parser = cli.build_parser()
  for argv in (["serve"], ["generate", "x"]):
    args = parser.parse_args([*argv, "--speculative-config", text])
    assert flags.engine_config(args, "cpu").speculative == SpeculativeConfig(
        num_speculative_tokens=3, prompt_lookup_max=5)
    assert flags.engine_config(parser.parse_args(argv), "cpu").speculative is None
  assert parser.parse_args(["plan", "--compile", "v5e", "--speculative-config", text]
                           ).speculative_config.num_speculative_tokens == 3
  with pytest.raises(SystemExit):
    parser.parse_args(["generate", "x", "--speculative-config", '{"num_speculative": 3}'])
  assert "unknown keys ['num_speculative']" in capsys.readouterr().err


def test_prometheus_counts_under_vllm_names_beside_ours():
  import types

  from jaxserve.batching.plan import EngineInfo
  from jaxserve.batching.scheduler import Scheduler
  from jaxserve.serving.metrics import Metrics
  info = EngineInfo(num_slots=2, page_size=16, num_pages=8, max_model_len=64, max_prefill_len=32,
                    can_share_pages=True, vocab_size=100, speculative=SpeculativeConfig())
  scheduler = Scheduler(SchedulerConfig(), types.SimpleNamespace(info=info))
  scheduler.spec_stats.record(4, 2)
  scheduler.spec_stats.record(3, 0)
  metrics = Metrics()
  metrics.watch(scheduler)
  text = metrics.exposition().decode()
  for prefix in ("jaxserve:", "vllm:"):
    assert f"{prefix}spec_decode_num_draft_tokens_total 7.0" in text
    assert f"{prefix}spec_decode_num_accepted_tokens_total 2.0" in text
    assert f'{prefix}spec_decode_num_accepted_tokens_per_pos_total{{position="1"}} 1.0' in text
    assert f'{prefix}spec_decode_num_accepted_tokens_per_pos_total{{position="2"}} 0.0' in text
  assert scheduler.spec_stats.acceptance_rate == 2 / 7
