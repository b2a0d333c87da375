"""Option parsing shared by the operator commands (``export_sessions``, ``prune_sessions``)."""
from __future__ import annotations

import argparse
from datetime import datetime, time

from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime


def moment(value: str) -> datetime:
    """``YYYY-MM-DD`` (midnight at the start of that day in ``settings.TIME_ZONE``, UTC by default) or
    an ISO 8601 date-time (naive means ``TIME_ZONE``) → an aware datetime. For argparse's ``type=``:
    raises ``argparse.ArgumentTypeError`` on anything else."""
    try:
        parsed = parse_datetime(value)
        if parsed is None:
            day = parse_date(value)
            parsed = None if day is None else datetime.combine(day, time.min)
    except ValueError as exc:  # well-formed but impossible, e.g. 2026-02-30
        raise argparse.ArgumentTypeError(f"{value!r}: {exc}") from exc
    if parsed is None:
        raise argparse.ArgumentTypeError(f"{value!r} is not YYYY-MM-DD or an ISO 8601 date-time")
    return parsed if timezone.is_aware(parsed) else timezone.make_aware(parsed)
