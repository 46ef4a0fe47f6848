def ragged_paged_attention(*a, **k): raise NotImplementedError
