"""The admin's forms: creating a session and running a turn. They check shape and policy so that bad
input is a form error; the writes are the services' (``services.session_create``, ``turn_enqueue``)."""
from __future__ import annotations

from typing import Any

from django import forms

from .. import policy, selectors
from ..models import Session
from ..services import MAX_INPUT_CHARS, ON_BUSY


class SessionCreateForm(forms.ModelForm):
    """Owner, optional id (else ``sess-<hex>``), title and ``model_config``, checked by
    ``policy.validate_model_config`` for the owner (staff-only settings refused for others)."""

    id = forms.CharField(required=False, max_length=64, help_text="Optional; empty picks sess-<hex>.")
    model_config = forms.JSONField(
        required=False, initial=dict,
        help_text='Codex settings, e.g. {"model": "gpt-5.5", "sandbox": "read-only", "approval_policy": "never"}.',
    )

    class Meta:
        model = Session
        fields = ["id", "owner", "title", "model_config"]

    def clean_id(self) -> str:
        value = (self.cleaned_data.get("id") or "").strip()
        if value and not selectors.is_valid_session_id(value):
            raise forms.ValidationError(
                "A session id is 1-64 characters: letters, digits, '.', '_', ':' or '-', starting with a letter or digit."
            )
        if value and Session.objects.filter(pk=value).exists():
            raise forms.ValidationError(f"session id {value!r} is already taken")
        return value

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        owner = cleaned.get("owner")
        config = cleaned.get("model_config") or {}
        if owner is not None:
            try:
                cleaned["model_config"] = policy.validate_model_config(config, is_staff=bool(owner.is_staff))
            except policy.PolicyError as exc:
                self.add_error("model_config", str(exc))
        return cleaned

    def _post_clean(self) -> None:
        # The model's own validation would reject the blank id the service fills in; the service
        # validates the row it makes (session_create → full_clean).
        pass


class TurnRunForm(forms.Form):
    """The session page's "Run a turn" form (``turn_enqueue``'s input and ``on_busy``)."""

    input = forms.CharField(widget=forms.Textarea(attrs={"rows": 3, "cols": 80}), max_length=MAX_INPUT_CHARS, strip=False)
    on_busy = forms.ChoiceField(choices=[(c, c) for c in ON_BUSY], initial="enqueue")

    def clean_input(self) -> str:
        value = self.cleaned_data["input"]
        if not value.strip():
            raise forms.ValidationError("input must not be empty")
        return value
