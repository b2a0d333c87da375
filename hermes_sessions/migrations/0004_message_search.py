"""Message search and the admin's indexes (issue 8).

* ``hermes_message_search_vector(text)``: ``to_tsvector('simple', coalesce(content, ''))`` as a
  PL/pgSQL function with its true cost (``models.MessageSearchVector`` says why), and
  ``message_content_search``, a GIN expression index on it (``models.MESSAGE_SEARCH_CONFIG`` says why
  ``simple``). An expression index rather than a stored tsvector column: no second copy of every text.
* ``notice_unacked_session``: partial index on the few unacknowledged notices.
* ``session_updated_id``: the admin's sessions list order.
"""
import django.contrib.postgres.indexes
from django.db import migrations, models

import hermes_sessions.models

CREATE_FUNCTION = """
CREATE FUNCTION hermes_message_search_vector(content text) RETURNS tsvector
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE COST 1000 AS $$
BEGIN
    RETURN to_tsvector('simple'::regconfig, coalesce(content, ''));
END
$$"""
DROP_FUNCTION = "DROP FUNCTION IF EXISTS hermes_message_search_vector(text)"


class Migration(migrations.Migration):

    dependencies = [
        ('hermes_sessions', '0003_turn_events'),
    ]

    operations = [
        migrations.RunSQL(CREATE_FUNCTION, DROP_FUNCTION),
        migrations.AddIndex(
            model_name='message',
            index=django.contrib.postgres.indexes.GinIndex(
                hermes_sessions.models.MessageSearchVector('content'), name='message_content_search'
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
