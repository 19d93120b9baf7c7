"""The names `--tool-call-parser` accepts, in a module of their own: the CLI reads them before it imports
the serving stack (see `server.cli`). `server.tool_calls.selection.PARSERS` maps each to its parser."""

TOOL_CALL_PARSER_NAMES = ("deepseek_v3", "glm45", "hermes", "kimi_k2", "minimax_m2", "mistral", "qwen3_coder")
