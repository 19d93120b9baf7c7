"""Structured output: constrain sampling to a JSON schema, JSON, a regex or an EBNF grammar (xgrammar)."""
