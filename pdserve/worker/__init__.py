"""Worker processes: the scheduler loop thread and the internal HTTP API.

The API is described in pdserve/worker/API.md; its messages are the types of pdserve.worker_api.
"""
