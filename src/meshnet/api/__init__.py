"""OpenAI-compatible HTTP API in front of a mesh (``meshnet api``; ``meshnet up --api-port``).

``create_app(backend)`` builds the FastAPI app; ``local_backend`` / ``mesh_backend`` build the backend over
an in-process chain or a running mesh; ``start_api_in_thread`` serves it with uvicorn in a thread.
"""

from meshnet.api.app import create_app
from meshnet.api.backend import ApiBackend, local_backend, mesh_backend

__all__ = ["ApiBackend", "create_app", "local_backend", "mesh_backend"]
