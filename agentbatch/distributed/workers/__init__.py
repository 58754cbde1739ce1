"""The distributed engine's workers: Celery app, turn/tool tasks, recovery sweep.

``celery -A agentbatch.distributed.workers worker -Q inference -P threads`` works, and so does
``agentbatch worker --queues inference``.
"""

from agentbatch.distributed.workers.tasks import app

__all__ = ["app"]
