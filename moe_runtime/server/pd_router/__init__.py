"""The P/D router: `moe-serve router --prefill URL... --decode URL...`.

It takes OpenAI requests, runs each prompt on a prefill instance (which parks the prompt's KV and
answers with a handle), then hands the request and the handle to a decode instance, whose answer,
streamed or whole, goes back to the client. See docs/design.md, "Prefill/decode disaggregation".
"""
