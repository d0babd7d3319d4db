"""The OpenAI-compatible HTTP front end (docs/http.md): h11 on the daemon's trio loop.

`server` owns the sockets and the HTTP/1.1 framing (h11), `app` routes a parsed request to
the protocol's Api, `openai` translates request bodies into `complete`'s params and results
into OpenAI's (and llama.cpp's) replies, `sse` frames server-sent events, `errors` maps the
daemon's stable codes to HTTP statuses and OpenAI's error object.
"""
