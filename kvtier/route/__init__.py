"""``kvtier route``: send each request to the engine instance that already holds its prefix.

The files follow a request through the router:

* :mod:`~kvtier.route.prompt`: the request's token ids and block keys, computed as the backends do;
* :mod:`~kvtier.route.index`: which backend holds which key, in which tier (from their block
  events), and a guess from what was routed where (while a backend's events are lost, or not yet come);
* :mod:`~kvtier.route.subscribe`: the event streams that keep that index (kvtier's and vLLM's);
* :mod:`~kvtier.route.vllm`: vLLM's KV events (ZMQ, msgpack), its block hashes turned into kvtier keys;
* :mod:`~kvtier.route.choice`: the policies that pick a backend (round robin, least loaded, kvtier);
* :mod:`~kvtier.route.backends`: the backends' health and load (open requests, prefill tokens queued);
* :mod:`~kvtier.route.answer`: a backend's answer read under bounds (time to first output, silence,
  size) and checked to be one before any of it reaches the client;
* :mod:`~kvtier.route.proxy`: forwarding, chunk by chunk, retried elsewhere before the first byte;
* :mod:`~kvtier.route.app`: the OpenAI-compatible front, ``/stats`` and ``/metrics``;
* :mod:`~kvtier.route.control`: the fleet control API (``/fleet/*``: lookup, pins, prefetch, clear, usage),
  each call fanned out to every backend's admin routes, a down backend reported as down;
* :mod:`~kvtier.route.pins`: the fleet pins' account (ids, backends, expiry), so releasing one keeps the others.

The router decides from events and load; it never holds a request's bytes
longer than the stream, and never touches KV.
"""
