"""The kvcache daemon, ``python -m kvcache.server``: one process owns the cache for every engine
on a host.

``__main__`` (flags, TOML, signals) -> ``daemon`` (ZMQ ROUTER loop, worker lanes, reaper) ->
``handlers`` (one per request, calling ``CacheEngine``); ``registry`` tracks instances and
heartbeats; ``ipc`` shares tensors (CPU: /dev/shm, GPU: CUDA IPC); ``launch`` starts a daemon
as a child process. Importing this package starts nothing.
"""
