"""Message search and the admin's indexes (issue 8).

* ``message_content_search``: a GIN expression index on ``to_tsvector('simple', coalesce(content, ''))``
  (``models.MESSAGE_SEARCH_CONFIG`` says why ``simple``), PostgreSQL only — on SQLite (the embedded
  demo) the operation is skipped and ``selectors.message_search`` falls back to ``icontains``. An
  expression index rather than a stored tsvector column: no model field that SQLite could not have,
  no second copy of every transcript text; the cost is a ``to_tsvector`` per row when the planner
  rechecks, which the bench (``make bench-admin``) measures.
* ``notice_unacked_session``: partial index on the few unacknowledged notices.
* ``session_updated_id``: the admin's sessions list order.
"""
from typing import Any

import django.contrib.postgres.indexes
import django.contrib.postgres.search
from django.db import migrations, models


class AddPostgresIndex(migrations.AddIndex):
    """``AddIndex`` that builds the index only on PostgreSQL (the state always has it)."""

    def database_forwards(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any) -> None:
        if schema_editor.connection.vendor == "postgresql":
            super().database_forwards(app_label, schema_editor, from_state, to_state)

    def database_backwards(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any) -> None:
        if schema_editor.connection.vendor == "postgresql":
            super().database_backwards(app_label, schema_editor, from_state, to_state)


class Migration(migrations.Migration):

    dependencies = [
        ('hermes_sessions', '0002_rollouts'),
    ]

    operations = [
        AddPostgresIndex(
            model_name='message',
            index=django.contrib.postgres.indexes.GinIndex(
                django.contrib.postgres.search.SearchVector('content', config='simple'), name='message_content_search'
            ),
        ),
        migrations.AddIndex(
            model_name='notice',
            index=models.Index(condition=models.Q(('acknowledged_at__isnull', True)), fields=['session'], name='notice_unacked_session'),
        ),
        migrations.AddIndex(
            model_name='session',
            index=models.Index(fields=['-updated_at', '-id'], name='session_updated_id'),
        ),
    ]
