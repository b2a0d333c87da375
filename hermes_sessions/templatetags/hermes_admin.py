"""Template tags of the admin's templates (``{% load hermes_admin %}``)."""
from django import template

from .. import selectors

register = template.Library()


@register.simple_tag
def unacknowledged_notice_count() -> int:
    """Notices waiting for an operator across all sessions (``selectors.unacknowledged_notice_count``)."""
    return selectors.unacknowledged_notice_count()


@register.simple_tag
def pending_approval_count() -> int:
    """Approvals waiting for a person's decision across all sessions (``selectors.pending_approval_count``)."""
    return selectors.pending_approval_count()
