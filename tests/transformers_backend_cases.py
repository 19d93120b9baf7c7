"""What the transformers-backend test files share: their prompts, the tiny dense shape, the chunked layout."""
from __future__ import annotations

NEW_TOKENS = 6
PROMPTS = [  # longer than a KV block (16) and than every window (8)
    [(7 * i + 3) % 500 + 5 for i in range(40)],
    [(11 * i + 1) % 480 + 9 for i in range(23)],
    [(5 * i + 2) % 490 + 7 for i in range(9)],
]
# the tiny shape (each file sets its own num_hidden_layers)
SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
             initializer_range=0.05, bos_token_id=1, eos_token_id=2, pad_token_id=0)
CHUNKED = dict(max_num_batched_tokens=16, enable_chunked_prefill=True, enable_prefix_caching=True)
