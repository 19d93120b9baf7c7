"""The harmony format's markers (gpt-oss): each is one special token of the o200k_harmony vocabulary.

A message is `<|start|>{role}[ to={recipient}]<|channel|>{channel}[ to={recipient}][ <|constrain|>{type}]
<|message|>{body}` closed by `<|end|>`, by `<|call|>` (a tool call: generation stops there) or by
`<|return|>` (the final answer: generation stops there). See OpenAI's "harmony response format" guide.
"""

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
BODY_ENDS = (END, CALL, RETURN, START)    # what closes a message body (a new <|start|> too, if the model skips <|end|>)
STOPS = (RETURN, CALL)                    # the tokens generation stops at
FUNCTIONS = "functions."                  # the namespace of the request's tools: a recipient functions.NAME is a call
