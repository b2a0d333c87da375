"""The offline model stand-in: a local OpenAI Responses-API server that codex uses as its model in the
demo, the tests, ``make faults`` and ``make bench``. See :class:`ModelStandIn` for its endpoints and
magic words; ``python -m devtools.model_stand_in --port 8765`` runs it on its own."""
from devtools.model_stand_in.server import (
    CURRENT_TURN_MARKER,
    ModelStandIn,
    last_user_text,
    message_texts,
    steering_text,
)

__all__ = ["CURRENT_TURN_MARKER", "ModelStandIn", "last_user_text", "message_texts", "steering_text"]
