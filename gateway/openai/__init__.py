"""The OpenAI-compatible API: POST /v1/chat/completions, POST /v1/completions and
GET /v1/models (routes); their bodies read and parsed (body) and checked against the schema
(requests, structured, tool_calls); prompts to engine requests and back (generation); an
admitted request from the engine's first output to its record (admitted_request); responses
and stream chunks (responses); and the record of each request once it is over
(request_record), built from what it used (record_builder)."""
