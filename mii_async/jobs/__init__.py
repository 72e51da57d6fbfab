"""Background jobs: the OpenAI Files and Batches API's durable state (store.py), the check of a batch's input
file (batch_input.py), the runner that sends its lines through the gateway's routes (batch_runner.py), and the
objects the API answers with (openai_objects.py). docs/jobs.md describes the whole."""
from __future__ import annotations

from .batch_runner import BatchRunner
from .limits import JobLimits
from .store import JobStore

__all__ = ["BatchRunner", "JobLimits", "JobStore"]
