"""The codex integration: everything that knows JSON-RPC, codex method names or the rollout layout.

``client`` speaks newline-delimited JSON-RPC to one ``codex app-server`` process, ``errors`` classifies
what goes wrong (rotate / retry / fail), ``server_requests`` answers codex's own requests (approvals).
Facts about codex cite ``docs/codex.md`` (observed live on codex 0.169.0 and 0.171.0).
"""
