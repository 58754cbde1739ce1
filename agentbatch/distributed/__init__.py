"""The distributed engine: agent state in Redis (``state``), Celery workers running one task
per turn (``workers``), and the submit side and handle a user holds."""
