"""The distributed engine's workers: Celery app, turn/tool tasks, recovery sweep.

``celery -A agentbatch.workers worker -Q inference -P threads`` works, and so does
``agentbatch worker --queues inference``.
"""

from .tasks import app

__all__ = ["app"]
