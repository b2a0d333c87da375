"""The API's JSON renderer: DRF's, except that a lone UTF-16 surrogate in a body never becomes a 500.

Values the API stores are cleaned on the way in (``sanitize.clean_text``: a lone surrogate is kept as
U+FFFD), but a 400 can quote what the client sent — ``"\\ud800" is not a valid choice.`` for an
``on_busy`` of ``"\\ud800"``, a ``model_config`` key — and DRF's ``JSONRenderer`` encodes its
``ensure_ascii=False`` text as UTF-8, which cannot hold a lone surrogate: ``UnicodeEncodeError``, a 500
(invariant I6, ``tests/api/test_hostile_input.py``). Such a body is rendered again with every string cleaned."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rest_framework.renderers import JSONRenderer

from ..sanitize import clean_json


class SafeJSONRenderer(JSONRenderer):
    """``JSONRenderer`` that renders a body holding a lone surrogate with it replaced by U+FFFD
    (``sanitize.clean_json``; keys too) instead of raising ``UnicodeEncodeError``. Output is DRF's
    byte for byte otherwise."""

    def render(self, data: Any, accepted_media_type: str | None = None,
               renderer_context: Mapping[str, Any] | None = None) -> bytes:
        try:
            return super().render(data, accepted_media_type, renderer_context)
        except UnicodeEncodeError:
            return super().render(clean_json(data), accepted_media_type, renderer_context)
