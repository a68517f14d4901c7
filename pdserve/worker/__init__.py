"""Worker processes: the scheduler loop thread and the internal HTTP API (see worker_api.md)."""
