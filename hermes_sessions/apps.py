from django.apps import AppConfig


class HermesSessionsConfig(AppConfig):
    name = "hermes_sessions"
    verbose_name = "Hermes sessions"
    default_auto_field = "django.db.models.BigAutoField"
