"""`python -m scripts.bench embed`: embeddings per second, jaxserve (`LLM(task="embed")`) beside
transformers (AutoModel, last-token pooling, normalized, as sentence-transformers does for
Qwen3-Embedding) on the same weights, each side in a fresh process, rounds interleaved.

The workload: --inputs token-id inputs of --min-len to --max-len tokens (uniform, seed 0).
Without --model a random Qwen3 of --shape is built once (the default model's tokenizer) in
--work-dir. Each side's first call (compiles, first-touch) is untimed; the figure is the median
round. The two sides' embeddings are compared too (the worst cosine is printed).
"""

from __future__ import annotations

import json
import os
import pathlib
import time

import numpy as np

from . import harness

SIDES = ("jaxserve", "transformers")
SHAPES = {"small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=64),
          "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                             num_attention_heads=16, num_key_value_heads=8, head_dim=128)}


def _parser():
  p = harness.parser("embed", __doc__)
  p.add_argument("--model", default=None, help="an embedding model's folder (Hugging Face)")
  p.add_argument("--shape", default="small", choices=sorted(SHAPES))
  p.add_argument("--work-dir", default="/tmp/jaxserve-bench-embed")
  p.add_argument("--inputs", type=int, default=64)
  p.add_argument("--min-len", type=int, default=16)
  p.add_argument("--max-len", type=int, default=512)
  p.add_argument("--batch", type=int, default=8, help="transformers' batch (padded, left)")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--side", choices=SIDES, default=None, help="(internal) run one side")
  return p


def _model(args) -> str:
  if args.model:
    return args.model
  path = pathlib.Path(args.work_dir) / args.shape
  if not (path / "config.json").exists():
    import torch
    import transformers

    from jaxserve.loading import checkpoint

    tokenizer = checkpoint.load_model(None)[1]
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=tokenizer.vocab_size, max_position_embeddings=2048,
                                   tie_word_embeddings=True, **SHAPES[args.shape])
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tokenizer.save(path)
  return str(path)


def _inputs(args, vocab: int) -> list[list[int]]:
  rng = np.random.default_rng(0)
  lens = rng.integers(args.min_len, args.max_len + 1, args.inputs)
  return [rng.integers(100, vocab, n).tolist() for n in lens]


def _jaxserve(model: str, inputs, args):
  from jaxserve.config import EngineConfig
  from jaxserve.llm import LLM

  cfg = EngineConfig(num_slots=16, page_size=16, max_model_len=args.max_len + 16,
                     num_pages=16 * (args.max_len // 16 + 2) + 1,
                     prefill_buckets=(64, 128, 256, 512), max_prefill_seqs=8)
  llm = LLM(model, task="embed", engine_config=cfg)
  return lambda: np.stack(llm.embed(inputs))


def _transformers(model: str, inputs, args):
  import torch
  import transformers

  hf = transformers.AutoModel.from_pretrained(model, dtype=torch.float32).eval()

  def run():
    out = []
    for i in range(0, len(inputs), args.batch):
      batch = inputs[i:i + args.batch]
      n = max(len(x) for x in batch)
      ids = torch.tensor([[0] * (n - len(x)) + x for x in batch])  # Left padding.
      mask = torch.tensor([[0] * (n - len(x)) + [1] * len(x) for x in batch])
      with torch.no_grad():
        last = hf(input_ids=ids, attention_mask=mask).last_hidden_state[:, -1]
      out.append(torch.nn.functional.normalize(last, dim=-1).numpy())
    return np.concatenate(out)
  return run


def side(args) -> dict:
  model = _model(args)
  vocab = json.loads((pathlib.Path(model) / "config.json").read_text())["vocab_size"]
  inputs = _inputs(args, vocab)
  run = (_jaxserve if args.side == "jaxserve" else _transformers)(model, inputs, args)
  run()  # Untimed: compiles, first touch.
  start = time.perf_counter()
  vecs = run()
  seconds = time.perf_counter() - start
  np.save(pathlib.Path(args.work_dir) / f"{args.side}.npy", vecs)
  return {"side": args.side, "seconds": seconds, "per_s": len(inputs) / seconds,
          "tokens": sum(len(x) for x in inputs), "load_avg": os.getloadavg()[0]}


def main(argv) -> int:
  args = _parser().parse_args(argv)
  if args.side:
    print(json.dumps(side(args)), flush=True)
    return 0
  args.model = _model(args)  # Built once, before the sides.
  flags = [f for f in argv] + ["--model", args.model]
  rounds = harness.interleaved(SIDES, args.rounds,
                               lambda s: harness.fresh("embed", flags + ["--side", s]),
                               reverse_odd=True)
  work = pathlib.Path(args.work_dir)
  a, b = (np.load(work / f"{s}.npy") for s in SIDES)
  worst = float(np.min(np.sum(a * b, axis=1)))
  print(f"| side | embeddings/s | s for {args.inputs} | tokens |")
  print("|---|---|---|---|")
  for s in SIDES:
    r = harness.median_item(rounds[s], key=lambda r: r["per_s"])
    print(f"| {s} | {r['per_s']:.1f} | {r['seconds']:.2f} | {r['tokens']} |")
  print(f"worst cosine between the sides' embeddings: {worst:.6f}")
  return 0


COMMANDS = {"embed": main}
