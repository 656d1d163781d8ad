"""kvtier inside other engines: each module plugs the node's cache service into one engine's own cache hook.

Every connector keys blocks with kvtier's own :class:`~kvtier.keys.KeyHasher`
(stable across processes and restarts, never an engine's per-process hash)
and treats any failure of the service as a miss the engine recomputes.
"""
