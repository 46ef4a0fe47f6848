"""The models: the Llama-family decoder with its block's variants (Qwen3, Mistral, Phi-3, and the
mixtures of experts Qwen3-MoE and Mixtral) and Gemma 3's (families.py picks one per
ModelFamily), their attention over the paged KV cache, and the logical axes they are sharded by.

Shape letters, the one key for every comment, einsum and `x_BTD` name of jaxserve and of
kernels_pallas:
  B: batch (sequences, or decode rows)   T: query tokens (per sequence, or packed on one axis)
  S: key/value positions attended to     D: model dim
  N: query heads    K: KV heads    G: query heads per KV head (N = K * G)    H: head dim
  F: MLP hidden dim    V: vocabulary    L: layers    P: KV pages    Z: tokens per page
  W: pages per sequence (page-table width)
  X: last axis of a stored K or V array: H for values, 1 for their scales
  Kg: KV-head groups of a ragged page row (tp of them, each a device's heads; 1 without tp)

Mixture-of-experts letters (model/moe.py):
  Ex: experts    Ek: experts each token is routed to (top-k)    Fe: an expert's hidden dim
  M: routed rows (T * Ek: each token once per expert it is routed to), sorted by expert

LoRA letters (model/lora.py; its einsums spell them s, r, i, o):
  Sl: adapter slots (max_loras + 1; slot 0 is the base model)    Rk: LoRA rank (max_lora_rank)
  I, O: a projection's input and output widths (D, N * H, K * H or F)

Vision letters (model/siglip.py; its einsums spell them I, P, D, N, H, F, Q/K for patches as
queries and keys):
  Im: images    Pt: patches of an image    Dv: the vision tower's width    Nv: its heads
  Hd: its head dim    Fv: its MLP width    Mi: soft tokens of an image (mm_tokens_per_image)
  Qwen2.5-VL's (model/qwen_vision.py): Pb: an image's patches padded to its encoder bucket
  Cp: a patch's values (3 * temporal_patch_size * patch_size**2)
  Mu: patches merged into one token (merge_unit)

Engine letters (a step packs decode rows, then prefill sequences, on one axis):
  Bd: a step's decode rows    Bp: a step's prefill sequences (B = Bd + Bp)
  Tp: a step's prefill tokens, a prefill bucket (the packed token axis: T = Bd + Tp)
  Bs: decode slots (the engine's num_slots: the rows of the decode and sampling state)
  Pg: page groups of a KVCache (1, or 2 with window pages: the full pool, then the window pool)
  Vs: stop token ids    Vc: candidate tokens of one sampled row (engine/sample.py)

Kernel letters (kernels_pallas; A and R also in the query blocks of model/attention.py):
  Q: pages per chunk    C: KV positions of one chunk (C = Q * Z)    R: query rows of one block
  Tq: packed tokens of one query block    Gp: G padded for the hardware (GPU)
  A: a leading axis of query rows    E: lanes of the widest head window (TPU)
  Hv: lanes of Q, K and V one softmax step reads (H, or one TPU head window)
  Cr: lanes of one ragged page row (its K heads, then its V heads: 2 * K * H, then int8's 2 * K
      scale exponents, rounded up to 128)
"""
