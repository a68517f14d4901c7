"""Scheduling: the StepPlan a step runs by, and the scheduler that builds and applies it."""
from .plan import Inbox, NewRequest, ScheduledChunk, StepOutput, StepPlan
from .scheduler import Scheduler, SchedulerConfig

__all__ = ["Inbox", "NewRequest", "ScheduledChunk", "Scheduler", "SchedulerConfig", "StepOutput",
           "StepPlan"]
