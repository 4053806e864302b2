"""L2: the tiers behind the pool. One contract (``base``), one chunk record (``codec``), a thread
front that keeps adapters off the engine's threads (``async_front``), the factory that builds them
from the config, and the adapters (``disk``, ``redis/``)."""
