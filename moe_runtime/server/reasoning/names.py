"""The names `--reasoning-parser` accepts, in a module of their own: the CLI reads them before it imports the
serving stack (see `server.cli`). `server.reasoning.selection` maps each to its parser; the names are vLLM's
and SGLang's, so a deployment's flags carry over."""

REASONING_PARSER_NAMES = ("deepseek_r1", "deepseek_v3", "glm45", "gpt_oss", "kimi_k2", "minimax_m2",
                          "minimax_m2_append_think", "qwen3")
