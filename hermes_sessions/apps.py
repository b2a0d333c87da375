from django.apps import AppConfig


class HermesSessionsConfig(AppConfig):
    name = "hermes_sessions"
    verbose_name = "Hermes sessions"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Register the Celery tasks in every process, the API's included, before any request: the
        # first dispatches of a threaded API process raced on importing them lazily
        # (``NotRegistered: 'hermes_sessions.tasks.run_turn'``, found by ``make bench``'s throughput run
        # on gunicorn gthread workers), and the turn waited for the sweep.
        from . import tasks  # noqa: F401
