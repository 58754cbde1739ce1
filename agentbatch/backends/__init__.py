"""Inference backends: one ``Backend`` base class (its hooks declared there), chosen by URL scheme.

HTTP drivers are imported on first use via ``backend_from_url``; importing this package is
cheap and needs no optional dependency.
"""

from agentbatch.backends.aimd import AdaptiveBackend, AIMDController
from agentbatch.backends.base import Backend, BackendCapabilities, ServerLoad
from agentbatch.backends.pool import EndpointPool, parse_hostfile
from agentbatch.backends.registry import backend_from_url, register_driver
from agentbatch.backends.retry import RetryingBackend, RetryPolicy
from agentbatch.backends.urls import KNOWN_SCHEMES, BackendTarget, parse_backend_url

__all__ = [
    "KNOWN_SCHEMES",
    "AIMDController",
    "AdaptiveBackend",
    "Backend",
    "BackendCapabilities",
    "BackendTarget",
    "EndpointPool",
    "RetryPolicy",
    "RetryingBackend",
    "ServerLoad",
    "backend_from_url",
    "parse_backend_url",
    "parse_hostfile",
    "register_driver",
]
