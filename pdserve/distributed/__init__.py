"""Process groups and collectives for tensor parallelism."""
from .group import TPGroup

__all__ = ["TPGroup"]
