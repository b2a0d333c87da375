"""The operators' admin (``django.contrib.admin``), by page:

* ``sessions`` — the sessions list and the session page (create, run and cancel turns, end a binding,
  acknowledge notices, timeline, paged and searchable transcript);
* ``records`` — notices, turns, approvals and the message search (view-only audit records);
* ``approvals`` — what codex asks a person as the pages show it, and deciding it (the pending list, the
  approval's page, the session page's waiting section);
* ``webhooks`` — endpoints (register, re-enable) and deliveries with their attempts (send again);
* ``timeline`` — the session page's SVG; ``forms``; ``pagination`` (no count of a whole big table).

Staff see every session. Every write goes through ``hermes_sessions.services``.
"""
from . import records, sessions, webhooks  # noqa: F401 — importing registers the ModelAdmins
