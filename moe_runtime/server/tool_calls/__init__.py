"""Tool calling: which tools a request offers and how the model must use them (`plan`), one parser per
model family's output format (`hermes`, `deepseek_v3`, `mistral`, and `forced` for calls made through
structured output), and the stream that turns a choice's text into content and OpenAI tool-call deltas.
"""
