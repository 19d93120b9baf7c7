"""Plain records several stages share: a request's state inside a DP worker (`Sequence`), what the engine
returns for it (`TokenDelta`, `RequestOutput`), the checkpoint rows speculation rolls recurrent states back to."""
