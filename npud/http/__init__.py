"""The HTTP front end (docs/http.md): h11 on the daemon's trio loop, speaking OpenAI's,
Ollama's and llama.cpp's APIs.

`server` owns the sockets and the HTTP/1.1 framing (h11), `app` routes a parsed request to
the protocol's Api and runs every generating request as one job (App.spec, App.run),
`translate` turns OpenAI's and llama.cpp's bodies into `complete`'s params and results into
their replies, `ollama` and `ollama_translate` do the same for Ollama's /api/ endpoints (NDJSON
streams, `{"error"}` replies), `sse` frames server-sent events, `errors` maps the daemon's
stable codes to HTTP statuses and OpenAI's error object.
"""
