"""The Redis tier: one server (``single``), a Redis Cluster (``cluster``), the keyspace watchers
that report Redis's own evictions (``notify``, ``cluster_notify``) and the URL grammar (``url``)."""
