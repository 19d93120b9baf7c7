"""The embedded demo model and its tokenizer trainer."""
