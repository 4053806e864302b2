"""The kvcache daemon, ``python -m kvcache.server``: one process owns the cache for every engine
on a host.

``__main__`` (flags, TOML, signals) -> ``daemon`` (ZMQ ROUTER loop, worker lanes, reaper) ->
``handlers`` (one per request, calling ``CacheEngine``); ``registry`` tracks instances, their
tokens and heartbeats; ``auth`` decides who may connect and as whom; ``ipc`` shares tensors
(CPU: sealed memfds, GPU: CUDA IPC) and ``fdpass`` hands the memfds over; ``keygen`` makes
CURVE keys; ``launch`` starts a daemon as a child process. Importing this package starts nothing.
"""
