"""The API's JSON parser: DRF's, plus a refusal of pathologically nested documents.

Python's ``json`` recurses once per nesting level, so ``[[[[…`` 100,000 deep raises
``RecursionError`` (a 500) long before any size limit applies. Such a body is malformed for us.
"""
from collections.abc import Mapping
from typing import IO, Any

from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser


class SafeJSONParser(JSONParser):
    """``JSONParser`` that answers 400 instead of crashing on too-deeply nested JSON."""

    def parse(self, stream: IO[Any], media_type: str | None = None, parser_context: Mapping[str, Any] | None = None) -> Any:
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise ParseError("JSON parse error - the document is nested too deeply") from None
