"""``kvtier serve``: an OpenAI-compatible server over the built-in engine and the tiered cache.

The modules, in the order a request meets them: ``main`` (start-up) →
``app`` (routes) → ``limits`` (body size) → :mod:`kvtier.web.auth` (tenant,
admin) → ``inference`` (checks, prompts, responses) → ``loop`` (the engine
thread) → ``metrics`` (``/stats`` and ``/metrics``). What a client sends is
:mod:`kvtier.web.requests` (shared with ``kvtier route``); ``schemas`` is
what the server answers, ``errors`` its error shape, ``state`` what the
routes share.
"""
