"""Reasoning output (`--reasoning-parser`): a choice's text split into `reasoning_content` and content.

`names` lists the flag's values (read by the CLI before the serving stack is imported), `parser` says
what every parser answers, `think_tags` reads the `<think>...</think>` families, `selection` picks the
parser (and harmony, gpt-oss's channels, which `server.harmony_*` render and read).
"""
