"""The OpenAI-compatible API: POST /v1/chat/completions, POST /v1/completions and
GET /v1/models (routes); their bodies checked against the schema (requests, structured,
tool_calls); prompts to engine requests and back (generation); responses and stream chunks
(responses); and the record of each request once it is over (request_record)."""
