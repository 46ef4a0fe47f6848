"""The model: the Llama-family decoder, its attention and its paged KV cache.

Shape letters, the one key for every comment, einsum and `x_BTD` name of jaxserve and of
kernels_pallas:
  B: batch (sequences, or decode rows)   T: query tokens (per sequence, or packed on one axis)
  S: key/value positions attended to     D: model dim
  N: query heads    K: KV heads    G: query heads per KV head (N = K * G)    H: head dim
  F: MLP hidden dim    V: vocabulary    L: layers    P: KV pages    Z: tokens per page
  W: pages per sequence (page-table width)
  X: last axis of a stored K or V array: H for values, 1 for their scales

Kernel-only letters (kernels_pallas):
  Q: pages per chunk    C: KV positions of one chunk (C = Q * Z)    R: query rows of one block
  Tq: packed tokens of one query block    Gp: G padded for the hardware (GPU)
  A: a leading axis of query rows    E: lanes of the widest head window (TPU)
  Hv: lanes of Q, K and V one softmax step reads (H, or one TPU head window)
  Cr: lanes of one ragged page row (its K heads, then its V heads: 2 * K * H, rounded up to 128)
"""
