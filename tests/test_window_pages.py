"""Window pages: sliding-window layers keep only the pages their window can still see.

The mock engine writes every position through both tables and checks, at every query, that the
last `window` positions read back through the window table as through the page table; the
scheduler must hold exactly those pages, free the rest, and keep prefix caching, chunked prefill
and preemption working.
"""


from jaxserve.batching.runner import Runner
from jaxserve.config import SamplingParams, SchedulerConfig
from jaxserve.config.engine import window_pages_per_seq
from support.mock_engine import MockEngine, MockTokenizer, reference_generate, weighted_sum

WINDOW, PAGE, CHUNK, SLOTS = 8, 4, 8, 3
PER_SEQ = window_pages_per_seq(WINDOW, PAGE, CHUNK)  # 5: 14 positions span at most 5 pages of 4.


def make_runner(checked, num_pages=64, **config):
  engine = MockEngine(num_slots=SLOTS, page_size=PAGE, num_pages=num_pages, max_model_len=96,
                      max_prefill_len=CHUNK, next_token=weighted_sum, window=WINDOW,
                      num_window_pages=1 + SLOTS * PER_SEQ)  # As kv_cache.num_window_pages.
  return checked(Runner(engine, MockTokenizer(), SchedulerConfig(**config)))


def greedy(n):
  return SamplingParams(temperature=0, max_tokens=n)




def test_long_prompts_batched_and_chunked_match_the_reference(checked):
  r = make_runner(checked, max_num_batched_tokens=16)
  prompts = [[(7 * i + j) % 50 + 1 for j in range(n)] for i, n in enumerate((40, 23, 5, 31))]
  results = r.generate([(p, greedy(12)) for p in prompts])
  for p, res in zip(prompts, results):
    assert list(res.token_ids) == reference_generate(p, 12, weighted_sum)
  # The 40-token prompt's last chunk (positions 32..39) no longer holds the pages before the
  # window of its first query (position 32 sees 25..32: pages 6 on).
  last = [c for c in r.engine.chunks if c.request_id == results[0].request_id][-1]
  assert last.start_pos == 32 and not any(last.window_table[:6]) and all(last.window_table[6:10])
  # Every position of every layer kept: 40 + 12 tokens in pages of 4 is 13 pages; the window
  # table of that request never held more than PER_SEQ at once (the pool would have run out).
  assert r.scheduler.window_pages.num_usable_pages == SLOTS * PER_SEQ < SLOTS * 13


def test_preemption_recomputes_with_window_pages(checked):
  r = make_runner(checked, num_pages=20)  # 19 pages of 4: three 40-token requests preempt.
  prompts = [[(3 * i + j) % 40 + 1 for j in range(30)] for i in range(3)]
  results = r.generate([(p, greedy(14)) for p in prompts])
  assert r.scheduler.num_preemptions >= 1
  for p, res in zip(prompts, results):
    assert list(res.token_ids) == reference_generate(p, 14, weighted_sum)


def test_prefix_hits_need_the_window_pages_too(checked):
  r = make_runner(checked)
  shared = [100 + i for i in range(32)]  # 8 full pages.
  a = r.generate([(shared + [1], greedy(3))])[0]
  before = r.engine.num_prefill_tokens
  b = r.generate([(shared + [2], greedy(3))])[0]
  # Position 32 sees 25..32: pages 6 and 7 of the window pool were still cached.
  assert a.num_cached_tokens == 0 and b.num_cached_tokens == 32
  assert r.engine.num_prefill_tokens - before == 1
  assert list(b.token_ids) == reference_generate(shared + [2], 3, weighted_sum)
  # Other traffic churns the small window pool; the large page pool keeps the prefix.
  r.generate([([200 + 40 * i + j for j in range(40)], greedy(2)) for i in range(3)])
  prompt = shared + [3]
  assert len(r.scheduler.pages.match_prefix(prompt)) == 8
  c = r.generate([(prompt, greedy(3))])[0]
  assert c.num_cached_tokens < 32
  assert list(c.token_ids) == reference_generate(prompt, 3, weighted_sum)
