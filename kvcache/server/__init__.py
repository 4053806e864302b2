"""The kvcache daemon, ``python -m kvcache.server``: one process owns the cache for every engine
on a host.

``__main__`` (flags, TOML, signals) -> ``daemon`` (ZMQ ROUTER loop, worker lanes, reaper) ->
``handlers`` (one per request, calling ``CacheEngine``); ``registry`` tracks instances, their
tokens and heartbeats; ``auth`` decides who may connect and as whom; ``fdinbox`` receives the
memfds of CPU engines; ``keygen`` makes CURVE keys; ``launch`` starts a daemon as a child
process. Sharing tensors (memfds, CUDA IPC), endpoints and key files are ``kvcache.transport``,
which the client uses too; the server never imports ``kvcache.client``. Importing this package
starts nothing.
"""
