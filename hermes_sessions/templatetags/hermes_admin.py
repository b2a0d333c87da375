"""Template tags of the admin's templates (``{% load hermes_admin %}``)."""
from django import template

from .. import selectors
from ..models import Approval

register = template.Library()


@register.simple_tag
def unacknowledged_notice_count() -> int:
    """Notices waiting for an operator across all sessions (``selectors.unacknowledged_notice_count``)."""
    return selectors.unacknowledged_notice_count()


@register.simple_tag
def pending_approval_count() -> int:
    """Approvals waiting for a person's decision across all sessions (one ``COUNT``; pending rows are few:
    each is a turn that waits, and they end within ``HERMES_APPROVAL_TIMEOUT_SECONDS``)."""
    return Approval.objects.filter(status=Approval.Status.PENDING).count()
