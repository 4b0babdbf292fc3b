"""What every route of the gateway shares: the OpenAI-shaped exception tree and its handlers
(errors), request bodies parsed as JSON (json_body), the middleware that gives every
request an id and a processing time (request_context), the server's HTTP protocol (bounded
send buffers, a response may reset its connection: protocol), and server-sent event
streams whose client must keep reading (event_stream)."""
