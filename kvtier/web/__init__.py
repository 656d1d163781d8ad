"""The HTTP pieces both apps hold, ``kvtier serve`` (:mod:`kvtier.server`) and ``kvtier route`` (:mod:`kvtier.route`).

What a client sends (:mod:`.requests`), whom an API key names
(:mod:`.auth`) and how a listening socket is bound (:mod:`.listen`): one
definition each, so the router reads a request as the server will. Nothing
here imports the engine, the cache or either app.
"""
