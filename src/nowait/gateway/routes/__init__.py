"""The gateway's HTTP routes, one module per concern, each an `APIRouter` that app.py includes:
generation (chat and text completions), batch_api (files and batches), status (models, health,
readiness, metrics). Handlers only translate; the work is the `Gateway`'s (service.py).
"""
