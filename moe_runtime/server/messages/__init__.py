"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`): the request read into a chat
request (`conversion`), run as a chat, and answered as a message with content blocks, whole or as Anthropic's
event stream (`formatter`, `content_blocks`). Errors on these paths take Anthropic's shape (`server.errors`)."""
