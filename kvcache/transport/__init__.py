"""How an engine process and the daemon reach each other and share memory, beside
``kvcache.protocol`` (what they say to each other).

Both the client and the daemon import this package, and neither imports the other:

* ``endpoints``: where a daemon listens (runtime directory, ZMQ endpoint, fd socket);
* ``curve``: CURVE key files and the client's socket options;
* ``tensors``: an engine's KV tensors exported once, at registration, and mapped by the
  daemon; ``memfd`` (CPU, sealed memfds) and ``cuda_ipc`` (GPU, CUDA IPC handles) do the
  work, ``descriptors`` holds what both agree a descriptor means;
* ``fdpass`` / ``fdproto``: handing memfds to the daemon over its fd socket (the daemon's
  receiving end, which keeps state, is ``kvcache.server.fdinbox``);
* ``cuda_events``: the CUDA event that travels with each store and retrieve.

Importing this package starts nothing and imports no submodule.
"""
