"""Tool calling: which tools a request offers and how the model must use them (`plan`), one parser per
model family's output format (`hermes`, `deepseek_v3`, `mistral`, `glm45`, `minimax_m2`, `kimi_k2`,
`qwen3_coder`, and `forced` for calls made through structured output), the check every call passes before it
is sent (`call_check`, `offered_tools`, `safe_schema`), and the streams that turn a choice's text into content
and OpenAI tool-call deltas (`stream`, `forced_stream`).
"""
