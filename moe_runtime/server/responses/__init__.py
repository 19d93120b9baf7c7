"""OpenAI's Responses API (`POST /v1/responses`): the request read into a chat conversation (`input_items`,
`chat_request`), run as a chat, and answered as output items (`formatter`), whole or as the Responses event
stream; answers kept for `previous_response_id` in a bounded store per API key (`store`)."""
